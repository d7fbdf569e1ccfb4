"""Ops: the units of compute a schedule orders (docs/design.md §1).

An op names *what* runs — a pass of one stage over one micro-batch (and slice) — never *where*
or *when*: the device is implied by the list the op sits in, and times come from the simulator
in side tables keyed by the op.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

__all__ = ["OpKind", "Op", "OVERLAPPABLE"]


class OpKind(StrEnum):
    """Kinds of compute op.

    F   forward of a stage; if checkpointed it keeps only its input.
    R   recompute of a checkpointed F, restoring its activations for the backward.
    B   backward w.r.t. the stage input only (the activation gradient; Zero Bubble's "B").
    W   backward w.r.t. the stage weights, possibly cut into parts (Zero Bubble's "W").
    BW  fused backward: B then W, what autograd does by default.

    A forward and a backward (B or BW) next to each other on a device may run as one overlapped
    pair (DualPipe's F&B): the first carries `overlap_next`.
    """

    F = "F"
    R = "R"
    B = "B"
    W = "W"
    BW = "BW"


OVERLAPPABLE = frozenset({OpKind.F, OpKind.B, OpKind.BW})
"""The kinds an overlapped pair is made of: one forward and one backward."""


@dataclass(frozen=True, slots=True)
class Op:
    """One compute op of one stage on one micro-batch slice.

    `ckpt` is meaningful on F only (activations dropped, an R restores them); `part`/`parts`
    on W only (part `part` of `parts` equal shares of the weight-gradient work).
    Text form: ``{stage}{kind}{microbatch}[.{slice}][c][g][:{part}/{parts}][&]``, e.g. ``2F0``,
    ``2F0c`` (checkpointed), ``2R0g`` (recompute inside the backward), ``1BW3``, ``0W5:1/3``,
    ``3F1.2`` (slice 2), ``0F3&`` (overlapped with the next op: a schedule writes the pair as
    ``0F3&5BW1``).
    """

    kind: OpKind
    stage: int
    microbatch: int
    slice: int = 0
    ckpt: bool = False
    part: int = 0
    parts: int = 1
    after_grad: bool = False
    """R only: the recompute runs inside its backward, once the backward's input gradient has
    arrived (torch.utils.checkpoint's default), instead of as soon as its device is free."""
    overlap_next: bool = False
    """F, B or BW: runs together with the next op of its device, a backward with a forward or a
    forward with a backward (DualPipe's F&B), so that the communication inside one (expert
    all-to-all) hides under the other's compute. Both start when both inputs are there."""

    def __reduce__(self):
        """Pickled as its fields in a row: the tuner's workers send schedules of many ops."""
        fields = (self.kind, self.stage, self.microbatch, self.slice, self.ckpt, self.part, self.parts)
        return Op, fields + (self.after_grad, self.overlap_next)

    @property
    def key(self) -> tuple[int, int, int]:
        """(stage, microbatch, slice): what the dependency rules match on."""
        return (self.stage, self.microbatch, self.slice)

    @property
    def text(self) -> str:
        out = f"{self.stage}{self.kind.value}{self.microbatch}"
        if self.slice:
            out += f".{self.slice}"
        if self.ckpt:
            out += "c"
        if self.after_grad:
            out += "g"
        if self.parts != 1:
            out += f":{self.part}/{self.parts}"
        if self.overlap_next:
            out += "&"
        return out

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Op({self.text})"
