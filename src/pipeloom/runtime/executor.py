"""Run one device's op list of a pipeloom schedule for one training step (DESIGN §5).

F runs a stage forward (checkpointed: without autograd, keeping only its input); R re-runs it
with autograd (counted); B back-propagates to the stage input only (split linears queue their
weight GEMMs); W runs the queued GEMMs of its key (a run of consecutive W of one stage as one
GEMM if `concat_w`); BW is B then its W at once. The last stage turns logits into the loss,
scaled by 1 / (micro-batches × data-parallel replicas), so gradients accumulate to the mean.
Activations cross devices through `comm.plan_messages` (receives posted ahead) and stay in
memory between two stages of one device. The executor records every op's start and end and the
bytes its stash holds, for the trace and for checking the simulator.

With slices (MEPipe, TeraPipe) a micro-batch's sequence is cut into causal pieces. A slice's F
reads the keys and values its stage computed for the earlier slices of that micro-batch; each F
hands them on as fresh leaves, so the later slices' backwards accumulate their gradients there,
and the slice's own B back-propagates its output gradient together with those accumulated key
and value gradients — after every later slice's B, as the dependencies require. The keys and
values of a slice are dropped with its B, the last op that reads them. A W in parts runs its
share of the queued GEMMs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.errors import ConfigError, RuntimeFault
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.runtime.comm import Message, MessagePlan
from pipeloom.runtime.split_linear import WeightGradQueue

__all__ = ["StepRecord", "DeviceExecutor", "peer_failure"]

_F, _R, _B, _W, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.W, OpKind.BW


@dataclass
class StepRecord:
    loss: float = 0.0
    """Sum of this device's scaled micro-batch losses (last stage only)."""
    ops: list[tuple[str, float, float]] = field(default_factory=list)
    """(op text, start, end) in seconds from the step's start; an op starts once its inputs are here."""
    stash: list[tuple[float, int]] = field(default_factory=list)
    """(time, bytes held) after every change."""
    peak_stash_bytes: int = 0
    entry_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes each F and R added to the stash, by op text."""
    recomputes: int = 0


@dataclass
class _Entry:
    inputs: torch.Tensor | None = None
    output: torch.Tensor | None = None
    bytes: int = 0
    grad: torch.Tensor | None = None
    """The output gradient, when an R inside the backward already waited for it."""


class DeviceExecutor:
    """One device of the pipeline: its stage modules (already split-linear'd on `queue`)."""

    def __init__(
        self,
        schedule: Schedule,
        plan: MessagePlan,
        device: int,
        stages: dict[int, nn.Module],
        queue: WeightGradQueue,
        rank_of: Callable[[int], int],
        activation_shape: Sequence[int],
        loss_scale: float,
        loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        concat_w: bool = False,
        pair_groups: dict[tuple[int, int], dist.ProcessGroup] | None = None,
        device_type: torch.device | None = None,
        timeout_s: float = 60.0,
        before_forward: Callable[[int], None] | None = None,
    ) -> None:
        self.schedule, self.plan, self.device = schedule, plan, device
        self.ops = schedule.devices[device]
        self.stages, self.queue = stages, queue
        self.rank_of = rank_of
        self.num_slices = schedule.num_slices
        self.shape = tuple(activation_shape)
        if self.num_slices > 1:  # (batch, sequence, hidden): a slice is a piece of the sequence
            batch, seq, hidden = self.shape
            self.slice_len = seq // self.num_slices
            self.shape = (batch, self.slice_len, hidden)
        self.loss_scale = loss_scale
        self.loss_fn = loss
        self.concat_w = concat_w
        self.last_stage = schedule.num_stages - 1
        # One group per ordered pair of devices: each carries one direction only, so posting its
        # receives ahead in the sender's order can never block a send the other way (NCCL runs a
        # pair's operations in order on one stream).
        self.pair_groups = pair_groups or {}
        self.torch_device = device_type or torch.device("cpu")
        self.timeout = timedelta(seconds=timeout_s)  # a stalled peer fails the wait instead of hanging it
        self.before_forward = before_forward
        """Called with the stage before each F: T-Offload's RELOAD of weights stepped on the host."""
        self._parameter_ptrs = {p.data_ptr() for module in stages.values() for p in module.parameters()}
        self._has_split_linears = any(
            type(m).__name__ == "SplitLinear" for module in stages.values() for m in module.modules()
        )
        if any(op.kind is _W for op in self.ops) and not self._has_split_linears and stages:
            raise ConfigError(f"device {device} runs W ops but its linears are not split (split_linears)")
        self._saved_bytes: dict[tuple[OpKind, int, int], int] = {}  # once per (F or R, stage, slice)
        if self.num_slices > 1 and not all(hasattr(module, "forward_slice") for module in stages.values()):
            raise ConfigError("slices need stages with forward_slice (the LLaMA-style decoder's)")

    # -- one step ------------------------------------------------------------------------------

    def run_step(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> StepRecord:
        record = StepRecord()
        began = time.perf_counter()
        pending = self._post_receives()
        sends: list[tuple[dist.Work, str]] = []
        handed: dict[tuple[bool, int, int, int], torch.Tensor] = {}  # in-memory hand-over on this device
        stash: dict[tuple[int, int, int], _Entry] = {}
        kv: dict[tuple[int, int, int], tuple[list, list]] = {}  # slice key -> (keys/values, their leaves)
        held = 0
        skip_until = -1

        def note(change: int) -> None:
            nonlocal held
            held += change
            record.stash.append((time.perf_counter() - began, held))
            record.peak_stash_bytes = max(record.peak_stash_bytes, held)

        for index, op in enumerate(self.ops):
            if index <= skip_until:
                continue
            start = time.perf_counter() - began
            stage, mb, slice_ = op.key
            module = self.stages[stage]
            past = self._past(kv, op) if self.num_slices > 1 and op.kind in (_F, _R) else None
            target = self._cut(targets[mb], slice_) if stage == self.last_stage else None
            if op.kind is _F:
                x = self._cut(inputs[mb], slice_) if stage == 0 else self._take(pending, handed, False, op)
                if self.before_forward is not None:
                    self.before_forward(stage)
                start = time.perf_counter() - began  # the op's own time starts once its input is here
                entry = _Entry(inputs=x)
                if op.ckpt:
                    with torch.no_grad():
                        out, new_kv = self._run(module, x, past)
                    entry.bytes = _nbytes(x) + sum(_nbytes(k) + _nbytes(v) for k, v in new_kv)
                else:
                    out, entry.inputs, entry.bytes, new_kv = self._forward(module, op, x, target, past)
                    entry.output = out
                if past is not None:
                    kv[op.key] = (
                        new_kv,
                        [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in new_kv],
                    )
                if stage == self.last_stage:
                    loss = out if not op.ckpt else self._loss(out, target)
                    record.loss += float(loss.detach())
                else:
                    self._give(sends, handed, False, stage + 1, mb, slice_, out.detach())
                stash[op.key] = entry
                record.entry_bytes[op.text] = entry.bytes
                note(entry.bytes)
            elif op.kind is _R:
                entry = stash[op.key]
                if op.after_grad and stage != self.last_stage:  # recompute inside the backward
                    entry.grad = self._take(pending, handed, True, op)
                    start = time.perf_counter() - began
                entry.output, entry.inputs, saved, new_kv = self._forward(module, op, entry.inputs, target, past)
                if past is not None:
                    kv[op.key] = (new_kv, kv[op.key][1])  # the later slices read the F's leaves
                record.recomputes += 1
                record.entry_bytes[op.text] = saved
                note(saved)
                entry.bytes += saved
            elif op.kind in (_B, _BW):
                entry = stash.pop(op.key)
                grad = entry.grad
                if grad is None and stage != self.last_stage:
                    grad = self._take(pending, handed, True, op)
                    start = time.perf_counter() - began
                before = len(self.queue)
                outputs, grads = [entry.output], [grad]
                if self.num_slices > 1:  # and the gradients later slices sent into this slice's keys/values
                    graph, leaves = kv.pop(op.key)
                    for pair, leaf_pair in zip(graph, leaves):
                        for tensor, leaf in zip(pair, leaf_pair):
                            if leaf.grad is not None:
                                outputs.append(tensor)
                                grads.append(leaf.grad)
                torch.autograd.backward(outputs, grads)
                note(-entry.bytes)
                if stage > 0:
                    self._give(sends, handed, True, stage - 1, mb, slice_, entry.inputs.grad)
                if op.kind is _BW:
                    self.queue.run(op.key)  # with plain linears autograd did it already: nothing queued
                elif len(self.queue) == before and self._has_split_linears:
                    raise RuntimeFault(f"{op.text}: no weight gradients were queued")
            elif op.kind is _W and op.parts > 1:
                self.queue.run_part(op.key, op.part, op.parts)
            elif op.kind is _W:
                keys = [op.key]
                if self.concat_w:
                    while index + len(keys) < len(self.ops):
                        following = self.ops[index + len(keys)]
                        if following.kind is not _W or following.stage != stage or following.parts > 1:
                            break
                        keys.append(following.key)
                    skip_until = index + len(keys) - 1
                self.queue.run(*keys)
            record.ops.append((op.text, start, time.perf_counter() - began))
        for work, description in sends:
            try:
                work.wait(self.timeout)
            except RuntimeError as error:
                raise self._fault(description, error) from None
        if stash or kv or len(self.queue):
            raise RuntimeFault(f"device {self.device}: the step ended with work left (stash {list(stash)})")
        return record

    # -- helpers -------------------------------------------------------------------------------

    def _cut(self, tensor: torch.Tensor, slice_: int) -> torch.Tensor:
        """A micro-batch's tokens or targets, cut to one slice of the sequence."""
        if self.num_slices == 1:
            return tensor
        return tensor[:, slice_ * self.slice_len : (slice_ + 1) * self.slice_len]

    @staticmethod
    def _past(kv: dict, op: Op) -> list:
        """Per layer, the keys and values (leaves) of the earlier slices of the op's micro-batch."""
        earlier = [kv[(op.stage, op.microbatch, s)][1] for s in range(op.slice)]
        if not earlier:
            return []
        return [
            (
                torch.cat([layers[i][0] for layers in earlier], dim=-2),
                torch.cat([layers[i][1] for layers in earlier], dim=-2),
            )
            for i in range(len(earlier[0]))
        ]

    @staticmethod
    def _run(module: nn.Module, x: torch.Tensor, past: list | None):
        """(output, this slice's keys and values per layer); unsliced: (output, [])."""
        return module.forward_slice(x, past) if past is not None else (module(x), [])

    def _forward(
        self, module: nn.Module, op: Op, x: torch.Tensor, targets: torch.Tensor | None, past: list | None = None
    ):
        """Forward with autograd under the op's key, from a fresh leaf for the input so that B can
        read the input's gradient. Returns (output, or the loss on the last stage; that leaf; the
        bytes it keeps: tensors saved for backward, and the input itself for an F; the slice's
        keys and values)."""
        if x.is_floating_point():
            x = x.detach().requires_grad_(True)
        known = self._saved_bytes.get((op.kind, op.stage, op.slice))
        if known is not None:  # shapes repeat: the saved bytes of a stage's pass do too
            self.queue.current = op.key
            out, new_kv = self._run(module, x, past)
            return (self._loss(out, targets) if targets is not None else out), x, known, new_kv
        saved = [_nbytes(x) if op.kind is _F else 0]
        seen: set[int] = {x.data_ptr()}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            ptr = tensor.data_ptr()
            if ptr not in self._parameter_ptrs and ptr not in seen:
                seen.add(ptr)
                saved[0] += _nbytes(tensor)
            return tensor

        self.queue.current = op.key
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out, new_kv = self._run(module, x, past)
            if targets is not None:
                out = self._loss(out, targets)
        self._saved_bytes[(op.kind, op.stage, op.slice)] = saved[0]
        return out, x, saved[0], new_kv

    def _loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, targets) * self.loss_scale

    def _fault(self, doing: str, error: RuntimeError) -> RuntimeFault:
        """One line on this rank: what it was doing with which peer, and the backend's reason."""
        return RuntimeFault(f"rank {self.rank_of(self.device)} (device {self.device}): {doing}: {peer_failure(error)}")

    def _post_receives(self) -> dict[tuple[bool, int, int], tuple[torch.Tensor, dist.Work]]:
        pending = {}
        for message in self.plan.receives[self.device]:
            buffer = torch.empty(self.shape, device=self.torch_device)
            group = self.pair_groups.get((message.src, message.dst))
            try:
                work = dist.irecv(buffer, src=self.rank_of(message.src), group=group, tag=self.plan.tag(message))
            except RuntimeError as error:  # the pair is already broken: its peer is gone
                raise self._fault(f"posting a receive from rank {self.rank_of(message.src)}", error) from None
            pending[(message.grad, message.stage, message.microbatch, message.slice)] = (buffer, work, message.src)
        return pending

    def _take(self, pending, handed, grad: bool, op: Op) -> torch.Tensor:
        stage, mb, slice_ = op.key
        key = (grad, stage, mb, slice_)
        if key in handed:
            return handed.pop(key)
        buffer, work, src = pending.pop(key)
        try:
            work.wait(self.timeout)
        except RuntimeError as error:
            what = "gradient for B" if grad else "activation for F"
            raise self._fault(
                f"waiting for the {what}{stage} of micro-batch {mb} from rank {self.rank_of(src)}", error
            ) from None
        return buffer

    def _give(self, sends, handed, grad: bool, stage: int, mb: int, slice_: int, tensor: torch.Tensor) -> None:
        table = self.plan.backward_device if grad else self.plan.forward_device
        consumer = table[(stage, mb, slice_)]
        if consumer == self.device:
            handed[(grad, stage, mb, slice_)] = tensor.detach()
            return
        message = Message(grad, stage, mb, slice_, self.device, consumer)
        group = self.pair_groups.get((self.device, consumer))
        payload = tensor.detach().contiguous()
        what = f"the gradient for B{stage}" if grad else f"the activation for F{stage}"
        try:
            work = dist.isend(payload, dst=self.rank_of(consumer), group=group, tag=self.plan.tag(message))
        except RuntimeError as error:
            raise self._fault(f"sending {what} of micro-batch {mb} to rank {self.rank_of(consumer)}", error) from None
        sends.append((work, f"sending {what} of micro-batch {mb} to rank {self.rank_of(consumer)}"))


def peer_failure(error: RuntimeError) -> str:
    """The gist of a backend error about a peer: its first sentence, without source locations."""
    return str(error).split("] ", 1)[-1].split(". ", 1)[0].strip()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
