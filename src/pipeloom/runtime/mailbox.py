"""The torch side of a step's point-to-point messages: receives posted ahead, sends, hand-overs.

`comm.plan_messages` fixes who sends what to whom and in which order; a `Mailbox` carries it out
for one device and one step. A message is a tuple of tensors (a stage may hand several on); each
tensor travels as its own send with its own tag, in the same order on both sides, so tags
(gloo) and in-order pair streams (NCCL, which runs these on its own streams, overlapping compute)
agree. Gradients travel for the floating tensors only. Messages between two stages of one
device never leave memory. Every wait carries the run's timeout and turns a peer's failure into
one line that names the rank, the peer and the op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from pipeloom.errors import RuntimeFault
from pipeloom.runtime.boundary import TensorSpec
from pipeloom.runtime.comm import Message, MessagePlan

__all__ = ["Mail", "Mailbox", "MessageKey", "message_specs", "peer_failure"]

MessageKey = tuple[bool, int, int, int]
"""(gradient?, consuming stage, micro-batch, slice)."""


class Mail(Protocol):
    """What an executor needs of its transport: a step's messages in (`take`) and out (`give`)."""

    sent_bytes: int
    sent_dtypes: set[str]

    def open(self) -> None: ...

    def take(self, grad: bool, stage: int, microbatch: int, slice_: int) -> tuple[torch.Tensor, ...]: ...

    def give(self, grad: bool, stage: int, microbatch: int, slice_: int, tensors: Sequence[torch.Tensor]) -> None: ...

    def close(self) -> None: ...


class Mailbox:
    def __init__(
        self,
        plan: MessagePlan,
        device: int,
        boundaries: Sequence[tuple[TensorSpec, ...]],
        rank_of: Callable[[int], int],
        pair_groups: dict[tuple[int, int], dist.ProcessGroup],
        torch_device: torch.device,
        timeout: timedelta,
    ) -> None:
        self.plan, self.device, self.rank_of = plan, device, rank_of
        self.boundaries = boundaries
        self.pair_groups, self.torch_device, self.timeout = pair_groups, torch_device, timeout
        self.width = max((len(specs) for specs in boundaries), default=1)
        self.pending: dict[MessageKey, tuple[list[torch.Tensor], list[dist.Work], int]] = {}
        self.handed: dict[MessageKey, tuple[torch.Tensor, ...]] = {}
        self.sends: list[tuple[dist.Work, str, torch.Tensor]] = []
        self.sent_bytes = 0
        self.sent_dtypes: set[str] = set()

    def specs(self, grad: bool, stage: int) -> tuple[TensorSpec, ...]:
        return message_specs(self.boundaries, grad, stage)

    def open(self) -> None:
        """Post every receive of the step, in each sender's order."""
        self.pending, self.handed, self.sends = {}, {}, []
        self.sent_bytes, self.sent_dtypes = 0, set()
        for message in self.plan.receives[self.device]:
            buffers, works = [], []
            group = self.pair_groups.get((message.src, message.dst))
            for index, spec in enumerate(self.specs(message.grad, message.stage)):
                buffer = spec.empty(self.torch_device)
                try:
                    works.append(
                        posted(
                            dist.irecv(
                                buffer, src=self.rank_of(message.src), group=group, tag=self._tag(message, index)
                            )
                        )
                    )
                except RuntimeError as error:  # the pair is already broken: its peer is gone
                    raise self.fault(f"posting a receive from rank {self.rank_of(message.src)}", error) from None
                buffers.append(buffer)
            self.pending[(message.grad, message.stage, message.microbatch, message.slice)] = (
                buffers,
                works,
                message.src,
            )

    def take(self, grad: bool, stage: int, microbatch: int, slice_: int) -> tuple[torch.Tensor, ...]:
        key = (grad, stage, microbatch, slice_)
        if key in self.handed:
            return self.handed.pop(key)
        buffers, works, src = self.pending.pop(key)
        try:
            for work in works:
                work.wait(self.timeout)
        except RuntimeError as error:
            what = "gradient for B" if grad else "activation for F"
            raise self.fault(
                f"waiting for the {what}{stage} of micro-batch {microbatch} from rank {self.rank_of(src)}", error
            ) from None
        return tuple(buffers)

    def give(self, grad: bool, stage: int, microbatch: int, slice_: int, tensors: Sequence[torch.Tensor]) -> None:
        table = self.plan.backward_device if grad else self.plan.forward_device
        consumer = table[(stage, microbatch, slice_)]
        if consumer == self.device:
            self.handed[(grad, stage, microbatch, slice_)] = tuple(t.detach() for t in tensors)
            return
        message = Message(grad, stage, microbatch, slice_, self.device, consumer)
        group = self.pair_groups.get((self.device, consumer))
        what = f"the gradient for B{stage}" if grad else f"the activation for F{stage}"
        doing = f"sending {what} of micro-batch {microbatch} to rank {self.rank_of(consumer)}"
        for index, tensor in enumerate(tensors):
            payload = tensor.detach().contiguous()
            try:
                work = posted(
                    dist.isend(payload, dst=self.rank_of(consumer), group=group, tag=self._tag(message, index))
                )
            except RuntimeError as error:
                raise self.fault(doing, error) from None
            self.sends.append((work, doing, payload))  # the payload lives until its send is done
            self.sent_bytes += payload.numel() * payload.element_size()
            self.sent_dtypes.add(str(payload.dtype).removeprefix("torch."))

    def close(self) -> None:
        """Wait for this step's sends."""
        for work, doing, _ in self.sends:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                raise self.fault(doing, error) from None
        self.sends = []

    def fault(self, doing: str, error: RuntimeError) -> RuntimeFault:
        """One line on this rank: what it was doing with which peer, and the backend's reason."""
        return RuntimeFault(f"rank {self.rank_of(self.device)} (device {self.device}): {doing}: {peer_failure(error)}")

    def _tag(self, message: Message, index: int) -> int:
        return self.plan.tag(message) * self.width + index


def posted(work: dist.Work | None) -> dist.Work:
    """A point-to-point operation's handle: torch returns None only to a rank outside the group,
    which a plan never asks to send or receive."""
    if work is None:
        raise RuntimeFault("a send or receive was posted to a group this rank is not in")
    return work


def message_specs(boundaries: Sequence[tuple[TensorSpec, ...]], grad: bool, stage: int) -> tuple[TensorSpec, ...]:
    """What a message for `stage` holds: its input, or the gradient of its output (floating only)."""
    if grad:
        return tuple(spec for spec in boundaries[stage + 1] if spec.floating)
    return boundaries[stage]


def peer_failure(error: RuntimeError) -> str:
    """The gist of a backend error about a peer: its first sentence, without source locations."""
    return str(error).split("] ", 1)[-1].split(". ", 1)[0].strip()
