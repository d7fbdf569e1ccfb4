"""Messages between the devices of one process: the in-memory transport of `run_in_process`.

Every device of a schedule runs in this process, so a message is a tensor handed from one
executor to another. It is copied into a fresh buffer of the boundary's dtype, as a receive
buffer is filled over gloo, so the receiver never shares storage (or autograd history) with the
sender and both transports give the consumer the same values. The driver asks `has` before it
runs an op, so `take` never waits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pipeloom.errors import RuntimeFault
from pipeloom.runtime.boundary import TensorSpec
from pipeloom.runtime.comm import MessagePlan
from pipeloom.runtime.mailbox import MessageKey, message_specs

__all__ = ["MemoryMailbox", "Postbox"]

Postbox = dict[MessageKey, tuple[torch.Tensor, ...]]
"""The messages in flight between the devices of one step, shared by their mailboxes."""


class MemoryMailbox:
    def __init__(
        self, plan: MessagePlan, device: int, boundaries: Sequence[tuple[TensorSpec, ...]], postbox: Postbox
    ) -> None:
        self.plan, self.device, self.boundaries, self.postbox = plan, device, boundaries, postbox
        self.sent_bytes = 0
        self.sent_dtypes: set[str] = set()

    def open(self) -> None:
        self.sent_bytes, self.sent_dtypes = 0, set()

    def has(self, key: MessageKey) -> bool:
        return key in self.postbox

    def take(self, grad: bool, stage: int, microbatch: int, slice_: int) -> tuple[torch.Tensor, ...]:
        key = (grad, stage, microbatch, slice_)
        if key not in self.postbox:
            what = "gradient for B" if grad else "activation for F"
            raise RuntimeFault(f"device {self.device}: the {what}{stage} of micro-batch {microbatch} never came")
        return self.postbox.pop(key)

    def give(self, grad: bool, stage: int, microbatch: int, slice_: int, tensors: Sequence[torch.Tensor]) -> None:
        table = self.plan.backward_device if grad else self.plan.forward_device
        if table[(stage, microbatch, slice_)] == self.device:  # two stages of one device: no copy
            self.postbox[(grad, stage, microbatch, slice_)] = tuple(t.detach() for t in tensors)
            return
        specs = message_specs(self.boundaries, grad, stage)
        received = []
        for spec, tensor in zip(specs, tensors, strict=True):
            if tensor.is_cuda and tensor.dtype == spec.dtype and tuple(tensor.shape) == spec.shape:
                received.append(tensor.detach())  # every device is the one GPU: nothing to carry
            else:
                buffer = spec.empty(tensor.device)
                buffer.copy_(tensor.detach())
                received.append(buffer)
            self.sent_bytes += tensor.numel() * tensor.element_size()
            self.sent_dtypes.add(str(tensor.dtype).removeprefix("torch."))
        self.postbox[(grad, stage, microbatch, slice_)] = tuple(received)

    def close(self) -> None:
        """Nothing is in flight: every message was delivered when it was given."""
