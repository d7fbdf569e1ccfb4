"""What one step of one device holds while its ops run, and what it leaves on record.

`StepRecord` is the step as the trace, the summary and the simulator check see it (op times,
stash bytes, messages sent); `StepState` and its `StashEntry`s are the executor's working state:
each forward's inputs and outputs kept for its backward, the keys and values of earlier slices.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pipeloom.runtime.clocks import Clock, HostClock

__all__ = ["StashEntry", "StepRecord", "StepState", "Tensors"]

Tensors = tuple[torch.Tensor, ...]


@dataclass
class StepRecord:
    loss: float = 0.0
    """Sum of this device's scaled micro-batch losses (last stage only), as the host learned it
    at the step's end (`loss_sum` read once)."""
    loss_sum: torch.Tensor | None = None
    """The same on the device, summed as the micro-batches end (None: no loss on this device)."""
    ops: list[tuple[str, float, float]] = field(default_factory=list)
    """(op text, start, end) in seconds from the step's start; an op starts once its inputs are here."""
    began: float = 0.0
    """When the step began (`time.perf_counter`, shared by the processes of one machine): what
    lines up the ranks' op times, to see how long a message took from one rank's op to another's."""
    op_cpu: list[float] = field(default_factory=list)
    """Per entry of `ops`, the CPU seconds its thread ran during it (NaN for an overlapped pair's
    ops, which share two threads): on a CPU a wall time well above it means another process
    took the core — contention, which `profile` detects and refuses to fit."""
    stash: list[tuple[float, int]] = field(default_factory=list)
    """(time, bytes held) after every change."""
    peak_stash_bytes: int = 0
    entry_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes each F and R added to the stash, by op text."""
    pending_w_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes each B left queued for its W (the split linears' inputs and output gradients: the
    simulator's M_W), by the B's op text; W frees them (a W in k parts, 1/k each)."""
    recomputes: int = 0
    sent_bytes: int = 0
    """Bytes this device sent to other devices (activations and gradients)."""
    tp_sent_bytes: int = 0
    """Bytes this rank sent in its tensor-parallel group's collectives (`tensor_parallel`)."""
    kv_sent_bytes: int = 0
    """Bytes this rank sent in its context-parallel group's K/V exchanges (`models.context_parallel`)."""
    a2a_sent_bytes: int = 0
    """Bytes this rank sent to its expert-parallel group (`expert_parallel`)."""
    a2a_ms: float = 0.0
    """Milliseconds its expert all-to-alls were in flight, summed; `a2a_exposed_ms` of them it
    waited for (the rest ran under an overlapped pair's other op)."""
    a2a_exposed_ms: float = 0.0
    a2a_overlapped_ms: float = 0.0
    """The part of `a2a_ms` in flight while a paired op could run (pairs hide only that)."""
    a2a_forward_ms: float = 0.0
    """The forwards' share of `a2a_ms` (what `profile` fits a2a_F on; the rest is a2a_B's)."""
    expert_tokens: tuple[int, ...] = ()
    """(token, choice) pairs this rank routed to each expert, over its MoE layers."""
    sent_dtypes: tuple[str, ...] = ()
    """The dtypes of what it sent, e.g. ("bfloat16",)."""
    grad_sync_starts: tuple[tuple[tuple[int, ...], float], ...] = ()
    """(a gradient bucket's stages — or, under ZeRO-1, the stage of a sum over the replicas —,
    seconds from the step's start) of each gradient sum this rank started under the pipeline, as
    soon as those stages' last backward ended."""
    marks: _Marks | None = field(default=None, repr=False, compare=False)
    """The step's op and stash times as its clock marked them, until `settle` reads them."""

    def settle(self) -> None:
        """Turn the step's marks into `ops` and `stash` times, seconds from the step's start: at
        once on the host's clock, on a device's once it has passed them (after the step's read of
        the device). Reads nothing a second time."""
        marks, self.marks = self.marks, None
        if marks is None:
            return
        clock, origin = marks.clock, marks.origin
        self.ops += [(text, clock.seconds(origin, a), clock.seconds(origin, b)) for text, a, b in marks.ops]
        self.stash += [(clock.seconds(origin, moment), held) for moment, held in marks.stash]

    def add_loss(self, loss: torch.Tensor, grad_scale: float) -> None:
        """One micro-batch's loss, summed on the device in float64 (no host read)."""
        value = loss.detach().double() / grad_scale
        self.loss_sum = value if self.loss_sum is None else self.loss_sum + value


@dataclass
class _Marks:
    """A step's times as its clock marks them (`clocks`): host seconds, or CUDA events on the
    stream each op ran on."""

    clock: Clock
    origin: Any
    ops: list[tuple[str, Any, Any]] = field(default_factory=list)
    stash: list[tuple[Any, int]] = field(default_factory=list)


@dataclass
class StashEntry:
    inputs: Tensors = ()
    output: Tensors | None = None
    """The outputs to back-propagate from (the loss on the last stage)."""
    bytes: int = 0
    grads: Tensors | None = None
    """The output gradients, when an R inside the backward already waited for them."""
    middle: Tensors = ()
    """Partial checkpoint: the tail's input leaves (the head's output, computed without autograd)."""
    recomputed: Tensors = ()
    """Partial checkpoint: the head's output again, with autograd, from R."""


@dataclass
class StepState:
    """What one step's ops share. Its times are marks of `clock` — the host's on a CPU, CUDA
    events on the op's stream on a GPU, where a host clock around a kernel reads its launch —
    which the record turns into seconds once they can be read (`StepRecord.settle`)."""

    inputs: Sequence[Tensors]
    targets: Sequence[object]
    record: StepRecord
    began: float
    clock: Clock = field(default_factory=HostClock)
    stash: dict[tuple[int, int, int], StashEntry] = field(default_factory=dict)
    kv: dict[tuple[int, int, int], tuple[list, list]] = field(default_factory=dict)
    """Slice key → (its keys/values per layer, their leaves for the later slices)."""
    held: int = 0
    _start: Any = 0.0
    _cpu_start: float = 0.0

    def __post_init__(self) -> None:
        self.record.began = self.began
        self.record.marks = _Marks(self.clock, self.clock.mark())

    @property
    def start(self) -> Any:
        """When the current op's own time began (a mark of the clock); setting it also notes the
        thread's CPU clock, for `end_op`."""
        return self._start

    @start.setter
    def start(self, value: Any) -> None:
        self._start, self._cpu_start = value, time.thread_time()

    def end_op(self, text: str) -> None:
        """Record the op that began at `start` as ending now, with its thread's CPU time."""
        self.add_op(text, self._start, self.now(), time.thread_time() - self._cpu_start)

    def add_op(self, text: str, began: Any, ended: Any, cpu_seconds: float) -> None:
        """Record an op between two marks (`now`), with its thread's CPU seconds."""
        assert self.record.marks is not None, "the step's record is not settled yet"
        self.record.marks.ops.append((text, began, ended))
        self.record.op_cpu.append(cpu_seconds)

    def now(self) -> Any:
        """A mark of the clock, now (on a GPU: on the current stream)."""
        return self.clock.mark()

    def note(self, change: int) -> None:
        self.held += change
        assert self.record.marks is not None, "the step's record is not settled yet"
        self.record.marks.stash.append((self.now(), self.held))
        self.record.peak_stash_bytes = max(self.record.peak_stash_bytes, self.held)
