"""T-Pipe (TPipe, §4.1 and appendix A): chunked pipelining that starts every backward as early as
possible, so activations live briefly.

Stage s runs on device s mod p, as in interleaved 1F1B, but the steady state is periodic: every
device repeats the same cycle of slots — F B F B ... for v chunks, in units where a chunk's
forward takes 1 and its backward 2 (appendix A's T_B = 2 T_F) — and micro-batch j runs exactly
the template of micro-batch 0 shifted by j cycles. The template is built by following micro-batch 0
down its forwards and back up its backwards, giving each op the earliest free slot of its kind
(modulo the cycle) on its device once its input is there. Device d's cycle starts 2 units
earlier than device d-1's, so a backward flows on without waiting; where a forward reaches a slot
early it waits, which yields appendix A's intervals between chunks, (3 + 6⌈(p−3)/6⌉ − p) units
for the forwards and (3 + 6⌈(2p−3)/6⌉ − 2p) for the backwards.

The same construction with recompute slots is T-Recomp (`pipeloom.passes.trecomp`): a cycle
``F R B`` for each recomputed chunk, every R in the latest free recompute slot before its
backward — block-wise, so it never waits for a gradient and never shifts a dependency.

Only the order reaches the schedule; the simulator times it under any costs. Peak activation
memory depends on the order alone, so appendix A's counts hold for every cost model.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.registry import Tuning, register, require_int

__all__ = ["tpipe", "SlotTemplate", "slot_template", "schedule_from_template"]

F, R, BW = OpKind.F, OpKind.R, OpKind.BW
_UNITS = {F: 1, R: 1, BW: 2}


@dataclass(frozen=True, slots=True)
class SlotTemplate:
    """Micro-batch 0's start time (in units) of every op; micro-batch j adds j·period."""

    num_devices: int
    num_chunks: int
    recomputed: frozenset[int]
    """Chunks (0 = shallowest) whose forwards are checkpointed and recomputed block-wise."""
    period: int
    start: dict[tuple[OpKind, int], int]
    """(kind, stage) → start of micro-batch 0's op."""

    def round_of(self, stage: int) -> int:
        """Cycles between micro-batch 0's first forward and its forward of `stage` (on the first
        device of that chunk): the round in which the chunk starts."""
        return (self.start[F, stage] - self.start[F, 0]) // self.period


def slot_template(
    num_devices: int, num_chunks: int, recomputed: Collection[int] = (), wait_for_recompute: bool = False
) -> SlotTemplate:
    """Place micro-batch 0 slot by slot (see the module docstring). A recomputed chunk whose
    backward follows its forward too closely for a free recompute slot between them (the deepest
    chunk, at p ≥ 3) makes the backwards of recomputed chunks wait for one (`wait_for_recompute`)."""
    p, v = num_devices, num_chunks
    recomputed = frozenset(recomputed)
    pattern: list[OpKind] = []
    for chunk in range(v):  # one F, [R,] B group per chunk; recompute slots in the first groups
        pattern += [F, R, BW] if chunk < len(recomputed) else [F, BW]
    offsets, at = [], 0
    for kind in pattern:
        offsets.append(at)
        at += _UNITS[kind]
    period = at
    taken = [[False] * len(pattern) for _ in range(p)]

    def base(device: int) -> int:
        return -2 * device  # a backward reaches the next device down exactly at its slot

    def place(device: int, kind: OpKind, ready: int) -> int:
        best = None
        for slot, (slot_kind, offset) in enumerate(zip(pattern, offsets)):
            if slot_kind is kind and not taken[device][slot]:
                first = base(device) + offset
                start = first + math.ceil((ready - first) / period) * period
                if best is None or start < best[0]:
                    best = (start, slot)
        assert best is not None, "a cycle has one slot of each kind per chunk"
        taken[device][best[1]] = True
        return best[0]

    start: dict[tuple[OpKind, int], int] = {}
    ready = 0
    for stage in range(v * p):
        start[F, stage] = place(stage % p, F, ready)
        ready = start[F, stage] + _UNITS[F]
    recomputed_stages = {stage for chunk in recomputed for stage in range(chunk * p, (chunk + 1) * p)}
    for stage in reversed(range(v * p)):
        device, forward_end = stage % p, start[F, stage] + _UNITS[F]
        if stage in recomputed_stages and wait_for_recompute:
            # Where a chunk's backward follows its forward closely (the deepest chunk), the
            # backward waits for a free recompute slot between them, taken at once.
            earliest = _earliest_recompute_slot(pattern, offsets, period, taken[device], base(device), forward_end)
            start[BW, stage] = place(device, BW, max(ready, earliest + _UNITS[R]))
            start[R, stage] = _latest_recompute_slot(
                pattern, offsets, period, taken[device], base(device), start[BW, stage], not_before=forward_end
            )
        else:
            start[BW, stage] = place(device, BW, ready)
        ready = start[BW, stage] + _UNITS[BW]
    for chunk in sorted(recomputed):
        for stage in range(chunk * p, (chunk + 1) * p):
            if (R, stage) in start:
                continue
            start[R, stage] = _latest_recompute_slot(
                pattern, offsets, period, taken[stage % p], base(stage % p), start[BW, stage]
            )
            if start[R, stage] < start[F, stage] + _UNITS[F]:  # the paper's placement has no slot here
                return slot_template(num_devices, num_chunks, recomputed, wait_for_recompute=True)
    return SlotTemplate(p, v, recomputed, period, start)


def _earliest_recompute_slot(pattern, offsets, period, taken, base, ready) -> int:
    """The start of the earliest free recompute slot at or after `ready`."""
    starts = [
        base + offset + math.ceil((ready - base - offset) / period) * period
        for slot, (kind, offset) in enumerate(zip(pattern, offsets))
        if kind is R and not taken[slot]
    ]
    return min(starts)


def _latest_recompute_slot(pattern, offsets, period, taken, base, deadline, not_before=None) -> int:
    best = None
    for slot, (kind, offset) in enumerate(zip(pattern, offsets)):
        if kind is R and not taken[slot]:
            first = base + offset
            start = first + math.floor((deadline - _UNITS[R] - first) / period) * period
            if not_before is not None and start < not_before:
                continue
            if best is None or start > best[0]:
                best = (start, slot)
    assert best is not None, "one recompute slot per recomputed chunk"
    taken[best[1]] = True
    return best[0]


def schedule_from_template(template: SlotTemplate, num_microbatches: int, name: str) -> Schedule:
    """Every micro-batch on the template, each device's ops sorted by start."""
    p = template.num_devices
    timed: list[list[tuple[int, Op]]] = [[] for _ in range(p)]
    recomputed_stages = {stage for chunk in template.recomputed for stage in range(chunk * p, (chunk + 1) * p)}
    for (kind, stage), first in template.start.items():
        ckpt = kind is F and stage in recomputed_stages
        for mb in range(num_microbatches):
            timed[stage % p].append((first + mb * template.period, Op(kind, stage, mb, ckpt=ckpt)))
    devices = [[op for _, op in sorted(ops, key=lambda item: item[0])] for ops in timed]
    return Schedule.build(name, devices, num_stages=template.num_chunks * p, num_microbatches=num_microbatches)


@register(
    "tpipe",
    family="tpipe",
    paper="TPipe (temporal-locality pipeline), §4.1, appendix A",
    summary="v chunks per device, backwards as early as possible: ~75% of 1F1B's activations, 1F1B's bubble",
    domain="p >= 2, v >= 2, m >= 1",
    options=("num_chunks",),
    tuning=Tuning("tpipe", chunks=(2,), min_devices=2, fallbacks=(("trecomp",), ("trecomp", "offload"), ("mario",))),
    pareto="fixed",
)
def tpipe(num_devices: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """T-Pipe: a periodic F B F B ... cycle per device, micro-batch j one cycle after j−1.

    >>> print(tpipe(2, 2).to_text().splitlines()[1])
    0F0 2F0 0F1 2BW0 2F1 2BW1 0BW0 0BW1
    """
    require_int("tpipe", "num_devices (p)", num_devices, 2)
    v = require_int("tpipe", "num_chunks (v)", num_chunks, 2)
    return schedule_from_template(slot_template(num_devices, v), num_microbatches, "tpipe")
