"""What each op costs and holds on a schedule of one shape: the rule every part reads.

`Costs` (`pipeloom.costs`) is what a user gives — scalars, per-stage or per-slice values, units;
`Costs.resolve` turns it into a `StageCosts` for one (devices, stages, slices) shape, whose lists
are indexed by ``stage * num_slices + slice``. The time and memory of an op are written here once
(docs/design.md §2) and read by the simulator, the schedulers, the passes and the exact solver.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import assert_never

from pipeloom.ir.ops import Op, OpKind

__all__ = ["StageCosts"]


@dataclass(frozen=True, slots=True)
class StageCosts:
    """Costs resolved for one schedule shape: lists indexed by ``stage * num_slices + slice``
    (M_static by stage alone). F, B, BW, F_BW and R are a lone op's whole time, its
    communication (a2a_F, a2a_B) included; BW is a fused backward's (`Costs.BW`, else B + W),
    F_BW the forward of its micro-batch (`Costs.F_BW`, else F: the same list)."""

    num_slices: int
    F: list[float]
    B: list[float]
    W: list[float]
    R: list[float]
    M_B: list[float]
    M_W: list[float]
    M_ckpt: list[float]
    M_static: list[float]
    comm: float
    a2a_F: list[float]
    a2a_B: list[float]
    BW: list[float]
    F_BW: list[float]

    def index(self, op: Op) -> int:
        """Where `op`'s stage and slice sit in the per-stage lists."""
        return op.stage * self.num_slices + op.slice

    # What an op costs and holds: the one definition the simulator, the schedulers, the passes
    # and the exact solver read. `time_of` / `delta_of` take a kind and a list index, for the
    # schedulers that work on indices; `duration` / `memory_delta` take an op. `kind is ...`
    # chains rather than `match`: these run for every op of every simulation, and an identity
    # test is several times cheaper than match's equality on a StrEnum. Both end in
    # assert_never, so mypy rejects a kind left out and an unknown one fails loudly.

    def time_of(self, kind: OpKind, i: int, parts: int = 1) -> float:
        """How long an op of `kind` at index `i` runs alone (a W in `parts` its share)."""
        if kind is OpKind.F:
            return self.F[i]
        if kind is OpKind.BW:
            return self.BW[i]
        if kind is OpKind.B:
            return self.B[i]
        if kind is OpKind.W:
            return self.W[i] / parts
        if kind is OpKind.R:
            return self.R[i]
        assert_never(kind)

    def delta_of(self, kind: OpKind, i: int, ckpt: bool = False, parts: int = 1) -> float:
        """What an op of `kind` at index `i` adds to its device's activation memory (negative:
        frees): F keeps M_B (checkpointed, its input M_ckpt); R restores the rest; B frees M_B
        but keeps M_W for its W; W frees its share of M_W; BW frees M_B."""
        if kind is OpKind.F:
            return self.M_ckpt[i] if ckpt else self.M_B[i]
        if kind is OpKind.BW:
            return -self.M_B[i]
        if kind is OpKind.B:
            return self.M_W[i] - self.M_B[i]
        if kind is OpKind.W:
            return -self.M_W[i] / parts
        if kind is OpKind.R:
            return self.M_B[i] - self.M_ckpt[i]
        assert_never(kind)

    def duration(self, op: Op) -> float:
        """How long `op` runs alone (an overlapped pair's time is `pair_time`'s)."""
        return self.time_of(op.kind, op.stage * self.num_slices + op.slice, op.parts)

    def memory_delta(self, op: Op) -> float:
        return self.delta_of(op.kind, op.stage * self.num_slices + op.slice, op.ckpt, op.parts)

    def pair_time(self, forward: int, backward: int, fused: bool, forward_fused: bool = False) -> float:
        """An overlapped F&B pair: forward of index `forward` (of a micro-batch whose backward is
        fused if `forward_fused`), backward (a BW if `fused`) of index `backward`. The two
        computations run back to back on the compute stream; each side's
        communication runs on the communication stream under the other side's compute, and only
        what that compute cannot cover shows: F + B + max(0, a2a_F − B) + max(0, a2a_B − F) in
        compute times — max(F + B, F + B + a2a_F + a2a_B − overlap) with overlap = min(a2a_F, B)
        + min(a2a_B, F)."""
        hidden_under_b = (self.BW if fused else self.B)[backward] - self.a2a_B[backward]
        hidden_under_f = (self.F_BW if forward_fused else self.F)[forward] - self.a2a_F[forward]
        return (
            hidden_under_f
            + hidden_under_b
            + max(0.0, self.a2a_F[forward] - hidden_under_b)
            + max(0.0, self.a2a_B[backward] - hidden_under_f)
        )
