"""Run one device's op list of a pipeloom schedule for one training step (docs/design.md §5).

Each op kind has its own handler (`_handler`), so a new op is one method: F runs a stage forward
(checkpointed: without autograd, keeping only its input); R re-runs it with autograd (counted).
With `recompute_layers` = k a checkpointed F runs only the stage's first k layers (its head,
`split_at`) without autograd and the rest with it; R re-runs the head, and the backward runs
through the tail, then through the head with the gradient the tail left at their boundary;
B back-propagates to the stage input only (split linears queue their weight GEMMs); W runs the
queued GEMMs of its key (a run of consecutive W of one stage as one GEMM if `concat_w`; a W in
parts its share); BW is B then its W at once — as is a B whose W follows at once, or any B on a
device alone in its pipeline: nothing fills the gap, so its forward leaves the linears ordinary
and autograd computes the weight gradients in the B; an overlapped F&B pair runs its two
handlers, the forward on a side stream on CUDA. With `compiled` the stages and the loss run
under `torch.compile` (`compiled`). The last stage turns its output into the loss,
scaled by 1 / (micro-batches × data-parallel replicas × slices) — and by fp16's loss scale — so
gradients accumulate to the mean. A stage takes and returns a tensor or a tuple of tensors; what
crosses each boundary was inferred once (`boundary.infer_boundaries`) and travels through the
step's `Mailbox` (receives posted ahead; in memory between two stages of one device). Forwards run
under the precision policy's autocast and hand their outputs on in the compute type. The executor
records every op's start and end and the bytes its stash holds, for the trace and for checking
the simulator. A forward-only schedule (evaluation) runs its F without autograd and stashes
nothing; the last stage adds up the loss.

With slices (MEPipe, TeraPipe) a micro-batch's sequence is cut into causal pieces. A slice's F
reads the keys and values its stage computed for the earlier slices of that micro-batch; each F
hands them on as fresh leaves, so the later slices' backwards accumulate their gradients there,
and the slice's own B back-propagates its output gradient together with those accumulated key
and value gradients — after every later slice's B, as the dependencies require. The keys and
values of a slice are dropped with its B, the last op that reads them.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import assert_never

import torch
from torch import nn

from pipeloom.errors import ConfigError, RuntimeFault
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.split_backward import w_at_once_keys
from pipeloom.runtime.clocks import Clock, clock_for
from pipeloom.runtime.compiled import compile_stages
from pipeloom.runtime.mailbox import Mail, MessageKey, peer_failure
from pipeloom.runtime.pair_baton import run_pair
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.split_linear import SplitLinear, WeightGradQueue
from pipeloom.runtime.stage_call import earlier_keys_values, run_stage, split_stage
from pipeloom.runtime.step_state import StashEntry, StepRecord, StepState, Tensors

__all__ = ["DeviceExecutor", "peer_failure", "run_stage"]

_F, _R, _B, _W, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.W, OpKind.BW


class DeviceExecutor:
    """One device of the pipeline: its stage modules (already split-linear'd on `queue`)."""

    def __init__(
        self,
        schedule: Schedule,
        device: int,
        stages: dict[int, nn.Module],
        queue: WeightGradQueue,
        mail: Mail,
        loss_scale: float,
        loss: Callable[[object, object], torch.Tensor],
        concat_w: bool = False,
        device_type: torch.device | None = None,
        before_forward: Callable[[int], None] | None = None,
        precision: Precision | None = None,
        recompute_layers: int | None = None,
        loss_context: Callable[[], contextlib.AbstractContextManager] | None = None,
        interleave_pairs: bool = False,
        compiled: bool = False,
        separate_w: bool = False,
    ) -> None:
        self.schedule, self.device = schedule, device
        self.ops = schedule.devices[device]
        self.stages, self.queue = stages, queue
        self.num_slices = schedule.num_slices
        self.loss_scale = loss_scale
        """Multiplies every micro-batch loss: 1 / (micro-batches × replicas × slices)."""
        self.grad_scale = 1.0
        """fp16's dynamic loss scale, set by the trainer every step; the recorded loss leaves it out."""
        self.loss_fn = loss
        self.loss_context = loss_context or contextlib.nullcontext
        """What the last stage's loss and its backward run in (tensor parallelism's
        `loss_parallel`, whose backward ops must see it too)."""
        self.concat_w = concat_w
        self.precision = precision or Precision()
        self.last_stage = schedule.num_stages - 1
        self.torch_device = device_type or torch.device("cpu")
        self.mail = mail
        """Where messages come from and go: gloo/NCCL (`Mailbox`) or memory (`MemoryMailbox`)."""
        self.before_forward = before_forward
        """Called with the stage before each F: T-Offload's RELOAD of weights stepped on the host."""
        self._parameter_ptrs = {p.data_ptr() for module in stages.values() for p in module.parameters()}
        # Stages whose weight gradients wait for W (a stage of convolutions only computes its
        # weight gradients in B, and its W has nothing to do).
        self._split_stages = {
            s
            for s, module in stages.items()
            if any(isinstance(m, SplitLinear) and m.queue is not None for m in module.modules())
        }
        self._saved_bytes: dict[tuple[OpKind, int, int, str, bool], int] = {}
        """Once per (F or R, stage, slice, part, linears split or ordinary): shapes repeat."""
        if self.num_slices > 1 and not all(hasattr(module, "forward_slice") for module in stages.values()):
            raise ConfigError(
                "slices need stages with forward_slice (the LLaMA-style decoder's, or a Hugging Face causal LM's)"
            )
        self.slice_len = 0
        self._pending_w: dict[tuple[int, int, int], tuple[int, int, int]] = {}
        """Per key, (the bytes its B left queued, those its W parts have not freed yet, parts run)."""
        self._step = StepState((), (), StepRecord(), 0.0)
        self._index = 0
        self.halves = (
            {s: split_stage(module, recompute_layers) for s, module in stages.items()} if recompute_layers else {}
        )
        """Per stage (head, tail) under a partial checkpoint; empty: checkpoints take whole stages."""
        self._w_at_once = (
            {op.key for op in self.ops if op.kind is _BW}
            if separate_w
            else w_at_once_keys(self.ops, schedule.num_devices == 1)
        )
        """Keys whose W runs inside their B (`passes.split_backward.w_at_once_keys`): nothing fills
        the gap, so their forwards leave the linears ordinary and B computes the weight gradients
        as autograd does. `separate_w` keeps every W its own op, a BW still one pass (the profiler
        times W apart, and a fused backward too)."""
        if compiled:
            self.loss_fn = compile_stages(stages, self.halves, loss)
        self._side = torch.cuda.Stream(self.torch_device) if self.torch_device.type == "cuda" else None  # pairs' F
        self.clock: Clock = clock_for(self.torch_device)
        """What times the ops: the host's clock on a CPU, CUDA events on the op's stream on a GPU."""
        self.interleave_pairs = interleave_pairs
        """Run an overlapped pair's two ops by turns, switching at each expert all-to-all (`pair_baton`)."""
        self.after_ops: Callable[[Sequence[Op]], None] | None = None
        """Called with the ops of each unit once it has run (the gradient buckets start a stage's
        all-reduce after its last backward: `GradientBuckets.watch`)."""

    # -- one step ------------------------------------------------------------------------------

    def run_step(self, inputs: Sequence[Tensors], targets: Sequence[object]) -> StepRecord:
        """Run the device's ops; `inputs[j]` / `targets[j]` are micro-batch j's data."""
        self.begin(inputs, targets)
        while not self.done:
            self.advance()
        return self.finish()

    # -- the same step, one unit at a time (for a driver that runs all devices in one process) ----

    def begin(self, inputs: Sequence[Tensors], targets: Sequence[object]) -> None:
        if self.num_slices > 1:
            self.slice_len = inputs[0][0].shape[1] // self.num_slices
        self._step = StepState(inputs, targets, StepRecord(), time.perf_counter(), self.clock)
        self._index = 0
        self.mail.open()

    @property
    def done(self) -> bool:
        return self._index >= len(self.ops)

    @property
    def next_op(self) -> Op:
        return self.ops[self._index]

    def needs(self) -> list[MessageKey]:
        """The messages the next unit (an op, an overlapped pair) waits for."""
        op = self.ops[self._index]
        unit = [op, self.ops[self._index + 1]] if op.overlap_next else [op]
        return [key for member in unit for key in self._inputs_of(member)]

    def advance(self) -> None:
        """Run the next unit: one op, an overlapped pair, or a run of W concatenated into one GEMM."""
        step, op, first = self._step, self.ops[self._index], self._index
        step.start = step.now()
        if op.kind is _W:
            self._index += self._weight_op(step, self._index)
        elif op.overlap_next:
            self._pair_op(step, op, self.ops[self._index + 1])
            self._index += 2
        else:
            self._handler(op.kind)(step, op)
            step.end_op(op.text)
            self._index += 1
        if self.after_ops is not None:
            self.after_ops(self.ops[first : self._index])

    def finish(self) -> StepRecord:
        step = self._step
        step.record.sent_bytes = self.mail.sent_bytes
        step.record.sent_dtypes = tuple(sorted(self.mail.sent_dtypes))
        self.mail.close()
        if self.schedule.forward_only:
            step.kv.clear()  # the slices' keys and values: no backward reads them
        if step.stash or step.kv or len(self.queue):
            raise RuntimeFault(f"device {self.device}: the step ended with work left (stash {list(step.stash)})")
        if self.clock.immediate:  # a device's marks wait for the step's read of the device (`RankRun.end_step`)
            step.record.settle()
        return step.record

    def _inputs_of(self, op: Op) -> list[MessageKey]:
        stage, mb, slice_ = op.key
        match op.kind:
            case OpKind.F:
                return [(False, stage, mb, slice_)] if stage > 0 else []
            case OpKind.R:
                return [(True, stage, mb, slice_)] if op.after_grad and stage != self.last_stage else []
            case OpKind.B | OpKind.BW:
                entry = self._step.stash.get(op.key)
                waited = entry is not None and entry.grads is not None  # an R inside the backward took it
                return [(True, stage, mb, slice_)] if stage != self.last_stage and not waited else []
            case OpKind.W:
                return []
            case _:
                assert_never(op.kind)

    # -- handlers, one per op kind ----------------------------------------------------------------

    def _handler(self, kind: OpKind) -> Callable[[StepState, Op], None]:
        """The handler of a lone op of `kind` (W runs through `_weight_op`, which may join a run
        of them into one GEMM)."""
        if kind is OpKind.F:
            return self._forward_op
        if kind is OpKind.R:
            return self._recompute_op
        if kind is OpKind.B or kind is OpKind.BW:
            return self._backward_op
        if kind is OpKind.W:
            return self._lone_weight_op
        assert_never(kind)

    def _forward_op(self, step: StepState, op: Op) -> None:
        stage, mb, slice_ = op.key
        module = self.stages[stage]
        if stage == 0:
            x = tuple(self._cut(t, slice_) for t in step.inputs[mb])
        else:
            x = self.mail.take(False, stage, mb, slice_)
        if self.before_forward is not None:
            self.before_forward(stage)
        step.start = step.now()  # the op's own time starts once its input is here
        past = earlier_keys_values(step.kv, op, self.num_slices)
        target = self._target(step, op)
        if self.schedule.forward_only:
            self._evaluate_op(step, op, x, past, target)
            return
        entry = StashEntry(inputs=x)
        if op.ckpt and self.halves:
            head, tail = self.halves[stage]
            with torch.no_grad():
                middle, _ = self._run(head, stage, x, None, hand_on=False)
            entry.middle = tuple(t.detach().requires_grad_() if t.is_floating_point() else t for t in middle)
            out, _, kept, _ = self._forward(tail, op, entry.middle, target, part="tail")
            entry.output, entry.bytes = out, sum(_nbytes(t) for t in x) + kept
        elif op.ckpt:
            with torch.no_grad():
                out, new_kv = self._run(module, stage, x, past)
            entry.bytes = sum(_nbytes(t) for t in x) + sum(_nbytes(k) + _nbytes(v) for k, v in new_kv)
        else:
            out, entry.inputs, entry.bytes, new_kv = self._forward(module, op, x, target, past)
            entry.output = out
        if past is not None:
            step.kv[op.key] = (
                new_kv,
                [(k.detach().requires_grad_(), v.detach().requires_grad_()) for k, v in new_kv],
            )
        if stage == self.last_stage:
            loss = out[0] if entry.output is not None else self._loss(out, target)
            step.record.add_loss(loss, self.grad_scale)
        else:
            self.mail.give(False, stage + 1, mb, slice_, out)
        step.stash[op.key] = entry
        step.record.entry_bytes[op.text] = entry.bytes
        step.note(entry.bytes)

    def _evaluate_op(self, step: StepState, op: Op, x: Tensors, past: list | None, target) -> None:
        """A forward-only schedule's F: no autograd, nothing stashed; the last stage adds its loss."""
        with torch.no_grad():
            out, new_kv = self._run(self.stages[op.stage], op.stage, x, past)
            if past is not None:
                step.kv[op.key] = (new_kv, new_kv)
            if op.stage == self.last_stage:
                step.record.add_loss(self._loss(out, target), self.grad_scale)
            else:
                self.mail.give(False, op.stage + 1, op.microbatch, op.slice, out)

    def _recompute_op(self, step: StepState, op: Op) -> None:
        stage = op.stage
        entry = step.stash[op.key]
        if op.after_grad and stage != self.last_stage:  # recompute inside the backward
            entry.grads = self.mail.take(True, *op.key)
            step.start = step.now()
        if self.halves:  # only the head was left out: re-run it, keep its output for the backward
            entry.recomputed, entry.inputs, saved, _ = self._forward(
                self.halves[stage][0], op, entry.inputs, None, part="head"
            )
            step.record.recomputes += 1
            step.record.entry_bytes[op.text] = saved
            step.note(saved)
            entry.bytes += saved
            return
        past = earlier_keys_values(step.kv, op, self.num_slices)
        entry.output, entry.inputs, saved, new_kv = self._forward(
            self.stages[stage], op, entry.inputs, self._target(step, op), past
        )
        if past is not None:
            step.kv[op.key] = (new_kv, step.kv[op.key][1])  # the later slices read the F's leaves
        step.record.recomputes += 1
        step.record.entry_bytes[op.text] = saved
        step.note(saved)
        entry.bytes += saved

    def _backward_op(self, step: StepState, op: Op) -> None:
        stage, mb, slice_ = op.key
        entry = step.stash.pop(op.key)
        grads = entry.grads
        if grads is None and stage != self.last_stage:
            grads = self.mail.take(True, stage, mb, slice_)
            step.start = step.now()
        before = len(self.queue)
        assert entry.output is not None, "F or R left the outputs to back-propagate from"
        outputs: list[torch.Tensor]
        out_grads: list[torch.Tensor | None]
        if stage == self.last_stage:
            outputs, out_grads = [entry.output[0]], [None]
        else:  # the floating outputs, in order, each with its received gradient
            assert grads is not None
            floating = [t for t in entry.output if t.is_floating_point()]
            pairs = [(t, g) for t, g in zip(floating, grads) if t.requires_grad]
            outputs, out_grads = [t for t, _ in pairs], [g for _, g in pairs]
        if self.num_slices > 1:  # and the gradients later slices sent into this slice's keys/values
            graph, leaves = step.kv.pop(op.key)
            for pair, leaf_pair in zip(graph, leaves):
                for tensor, leaf in zip(pair, leaf_pair):
                    if leaf.grad is not None:
                        outputs.append(tensor)
                        out_grads.append(leaf.grad)
        self.queue.backward_key = op.key  # read by the split linears' backward, on whatever thread runs it
        if outputs:
            with self.loss_context() if stage == self.last_stage else contextlib.nullcontext():
                torch.autograd.backward(outputs, out_grads)
        boundary = [(h, leaf.grad) for h, leaf in zip(entry.recomputed, entry.middle) if leaf.grad is not None]
        if boundary:  # partial checkpoint: on through the recomputed head
            torch.autograd.backward([h for h, _ in boundary], [g for _, g in boundary])
        self.queue.backward_key = None
        step.note(-entry.bytes)
        pending = self.queue.held_bytes(op.key) if op.kind is _B else 0
        if pending:  # what the split linears keep for this key's W, held until it runs
            self._pending_w[op.key] = (pending, pending, 0)
            step.record.pending_w_bytes[op.text] = pending
            step.note(pending)
        if stage > 0:
            input_grads = [
                t.grad if t.grad is not None else torch.zeros_like(t) for t in entry.inputs if t.is_floating_point()
            ]
            self.mail.give(True, stage - 1, mb, slice_, input_grads)
        if op.kind is _BW:
            self.queue.run(op.key)  # with plain linears autograd did it already: nothing queued
        elif len(self.queue) == before and stage in self._split_stages and op.key not in self._w_at_once:
            raise RuntimeFault(f"{op.text}: no weight gradients were queued")

    def _pair_op(self, step: StepState, first: Op, second: Op) -> None:
        run_pair(self, step, first, second)

    def _weight_op(self, step: StepState, index: int) -> int:
        """Run the W at `index` (with `concat_w`, and the W of its stage right after it, as one
        GEMM); return how many ops it consumed."""
        consumed = self.queue.run_ops(self.ops, index, self.concat_w)
        self._free_pending_w(step, self.ops[index : index + consumed])
        step.end_op(self.ops[index].text)
        return consumed

    def _lone_weight_op(self, step: StepState, op: Op) -> None:
        self.queue.run_ops([op], 0, concat=False)
        self._free_pending_w(step, [op])

    def _free_pending_w(self, step: StepState, ops: Sequence[Op]) -> None:
        """What these W ran no longer waits: each key's bytes, or a part's share of them (the
        last part the rest)."""
        for op in ops:
            if op.key not in self._pending_w:
                continue
            total, left, parts_run = self._pending_w[op.key]
            parts_run += 1
            freed = left if parts_run == op.parts else total // op.parts  # parts may run in any order
            if parts_run == op.parts:
                del self._pending_w[op.key]
            else:
                self._pending_w[op.key] = (total, left - freed, parts_run)
            step.note(-freed)

    # -- helpers -------------------------------------------------------------------------------

    def _target(self, step: StepState, op: Op):
        if op.stage != self.last_stage:
            return None
        return self._cut(step.targets[op.microbatch], op.slice)

    def _cut(self, tensor, slice_: int):
        """A micro-batch's tokens or targets, cut to one slice of the sequence."""
        if self.num_slices == 1:
            return tensor
        return tensor[:, slice_ * self.slice_len : (slice_ + 1) * self.slice_len]

    def _run(
        self, module: Callable, stage: int, x: Tensors, past: list | None, hand_on: bool | None = None
    ) -> tuple[Tensors, list]:
        hand_on = stage != self.last_stage if hand_on is None else hand_on
        return run_stage(module, x, past, self.precision, self.torch_device, hand_on=hand_on)

    def _forward(self, module: Callable, op: Op, x: Tensors, targets, past: list | None = None, part: str = "whole"):
        """Forward with autograd under the op's key, from fresh leaves for the floating inputs so
        that B can read their gradients. Returns (outputs, or (loss,) on the last stage; those
        leaves; the bytes it keeps: tensors saved for backward, and the inputs themselves for an
        F; the slice's keys and values). `part`: the whole stage, or a partial checkpoint's head
        (its output is not handed on) or tail (its input leaves are already made)."""
        if op.stage > 0 and part != "tail":
            x = tuple(t.detach().requires_grad_(True) if t.is_floating_point() else t for t in x)
        hand_on = False if part == "head" else None
        self.queue.deferring = op.key not in self._w_at_once
        cached = (op.kind, op.stage, op.slice, part, self.queue.deferring)
        known = self._saved_bytes.get(cached)
        if known is not None:  # shapes repeat: the saved bytes of a stage's pass do too
            out, new_kv = self._run(module, op.stage, x, past, hand_on)
            return (self._loss(out, targets),) if targets is not None else out, x, known, new_kv
        saved = [sum(_nbytes(t) for t in x) if op.kind is _F else 0]
        seen: set[int] = {t.data_ptr() for t in x}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            ptr = getattr(tensor, "_local_tensor", tensor).data_ptr()  # a DTensor's: its shard's
            if ptr not in self._parameter_ptrs and ptr not in seen:
                seen.add(ptr)
                saved[0] += _nbytes(tensor)
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            out, new_kv = self._run(module, op.stage, x, past, hand_on)
            if targets is not None:
                out = (self._loss(out, targets),)
        self._saved_bytes[cached] = saved[0]
        return out, x, saved[0], new_kv

    def _loss(self, output: Tensors, targets) -> torch.Tensor:
        value = output[0] if len(output) == 1 else output
        with self.loss_context():
            return self.loss_fn(value, targets).float() * (self.loss_scale * self.grad_scale)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
