"""V-shape building blocks (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory", §3).

A block places one micro-batch's six passes on every device — F of chunk 0 (stage d) and chunk 1
(stage 2p−1−d), B of chunk 1 then chunk 0, and their W — in unit slots, and repeats every
`PERIOD` = 6 slots, so each device is busy every slot of the steady state. A pass's slot is
fixed by its offset in the block; W take the free slots in the order their B ran (chunk 1
first), so every activation lives from its F to its W. Memory follows from those lifespans: a
chunk whose activation lives l slots holds about ⌈l / 6⌉ micro-batches (`block_memory` counts it
exactly), and the offsets are the dial: the paper's V-Min block keeps about a third of 1F1B's
activations, V-Half about half.

`block_schedule` repeats the block for m micro-batches, squeezes warm-up and drain (each pass to
the earliest free slot after its inputs, as long as the device's memory stays under a cap) and
orders each device's ops by slot; the simulator then times them under the real costs.

Memory in the slot model is "planned" with a per-chunk M_W that may exceed the real one: with
M_W = M_B a B frees nothing until its W, which keeps the squeeze from trading lifespans for
early release — the paper's model. The real peak is never above the planned one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = [
    "PERIOD",
    "VBlock",
    "WalkedDevice",
    "v_min_block",
    "v_half_block",
    "block_memory",
    "block_peak",
    "block_schedule",
    "earliest_fitting_slot",
    "slot_levels",
    "slot_schedule",
]

PERIOD = 6
"""Slots per micro-batch per device: F, B and W of two chunks."""
_FD, _FU, _BU, _BD, _WU, _WD = range(6)  # passes: chunk 0 = down (stage d), chunk 1 = up
_KIND = (OpKind.F, OpKind.F, OpKind.B, OpKind.B, OpKind.W, OpKind.W)
_UP = (False, True, True, False, True, False)


@dataclass(frozen=True)
class VBlock:
    name: str
    slots: tuple[tuple[int, int, int, int], ...]
    """Per device: slots of F chunk 0, F chunk 1, B chunk 1, B chunk 0 in the block."""

    @property
    def num_devices(self) -> int:
        return len(self.slots)


def v_min_block(p: int) -> VBlock:
    """The paper's V-Min: forwards down and up one slot apart, backwards right after; the gap of
    2 slots when 3 divides p keeps a device's four passes in distinct slots mod 6."""
    gap = 2 if p % 3 == 0 else 0
    return VBlock("v-min", tuple((i, 2 * p - 1 - i, 2 * p + gap + i, 4 * p + gap - 1 - i) for i in range(p)))


def v_half_block(p: int) -> VBlock:
    """The paper's V-Half: the down passes two slots apart, which doubles chunk 0's lifespan."""
    gap = 3 if p % 2 == 0 else 0
    return VBlock(
        "v-half", tuple((2 * i, 3 * p - 2 - i, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2) for i in range(p))
    )


def _place_w(times: list[list[int]]) -> None:
    """Append W slots (chunk 1's, then chunk 0's) to one device's pass times: each free slot takes
    the oldest pending W, chunk 1 first."""
    busy = sorted((t, kind) for kind in range(4) for t in times[kind])
    queues: dict[int, deque] = {_BU: deque(), _BD: deque()}
    w_up, w_down = [], []
    slot, i = 0, 0
    while i < len(busy) or queues[_BU] or queues[_BD]:
        if i < len(busy) and busy[i][0] == slot:
            kind = busy[i][1]
            if kind in queues:
                queues[kind].append(slot)
            i += 1
        elif queues[_BU]:
            queues[_BU].popleft()
            w_up.append(slot)
        elif queues[_BD]:
            queues[_BD].popleft()
            w_down.append(slot)
        slot += 1
    times[4:] = [w_up, w_down]


def _deltas(M_B: tuple[float, float], M_W: tuple[float, float]) -> list[float]:
    """Memory change of each pass, chunk (down, up) activations M_B, kept after B M_W."""
    down, up = 0, 1
    return [M_B[down], M_B[up], M_W[up] - M_B[up], M_W[down] - M_B[down], -M_W[up], -M_W[down]]


def block_memory(block: VBlock, device: int, M_B: tuple[float, float], M_W: tuple[float, float]) -> float:
    """Steady-state peak activation memory of `device` when the block repeats: the most
    micro-batches whose chunk lifespans (F to B for M_B − M_W, F to W for M_W) overlap one slot.
    `M_B`, `M_W`: per chunk (down, up)."""
    return block_peak(block, device, _deltas(M_B, M_W))


def block_peak(block: VBlock, device: int, deltas: list[float]) -> float:
    """`block_memory` from a device's pass deltas (`chunk_deltas`)."""
    repeats = 4 * len(block.slots) + 8  # the middle period lies past the warm-up (< 1.2p periods)
    times = [[slot + PERIOD * j for j in range(repeats)] for slot in block.slots[device]]
    _place_w(times)
    counts = [0.0] * PERIOD
    middle = PERIOD * repeats // 2
    # a micro-batch's pass changes memory at its slot; sum the live amounts at one period's slots
    for kind, slots in enumerate(times):
        for t in slots:
            for r in range(PERIOD):
                if t <= middle + r:
                    counts[r] += deltas[kind]
    return max(counts)


def _input_slot(times: list[list[list[int]]], p: int, d: int, kind: int, j: int) -> int:
    """The latest slot among this pass's inputs (-1 if none)."""
    dev = times[d]
    if kind == _FD:
        dep = times[d - 1][_FD][j] if d else -1
    elif kind == _FU:
        dep = times[d + 1][_FU][j] if d < p - 1 else dev[_FD][j]
    elif kind == _BU:
        dep = max(times[d - 1][_BU][j] if d else -1, dev[_FU][j])
    elif kind == _BD:
        dep = max(times[d + 1][_BD][j] if d < p - 1 else dev[_BU][j], dev[_FD][j])
    else:
        dep = dev[_BU if kind == _WU else _BD][j]
    return max(dep, dev[kind][j - 1]) if j else dep


def _squeeze(
    times, p: int, m: int, deltas: list[list[float]], cap: Sequence[float], kinds: Sequence[int], moving
) -> None:
    """Move each pass selected by `moving(slot)` (in slot order) to the earliest free slot after its
    inputs where its device's memory stays within `cap`. Memory is checked on the device's level
    over the slots a pass moves across (W explicit), or, without W (`kinds` of 4), by placing W
    again: moving a pass changes which slots are free for them."""
    with_w = len(kinds) == 6
    order = sorted((times[d][k][j], d, k, j) for d in range(p) for k in kinds for j in range(m))
    busy: list[set[int]] = [set() for _ in range(p)]
    for t, d, _, _ in order:
        busy[d].add(t)
    level = [slot_levels(times[d], deltas[d]) for d in range(p)] if with_w else []
    walks = [] if with_w else [WalkedDevice(times[d], deltas[d]) for d in range(p)]
    for t, d, k, j in order:
        if not moving(t):
            continue
        earliest = _input_slot(times, p, d, k, j) + 1
        delta, limit = deltas[d][k], cap[d] + 1e-9
        chosen = None
        if with_w:
            chosen = earliest_fitting_slot(level[d], busy[d], earliest, t, delta, limit)
        else:
            chosen = next((s for s in range(earliest, t) if s not in busy[d] and walks[d].fits(t, s, k, limit)), None)
        if chosen is None:
            continue
        times[d][k][j] = chosen
        busy[d].discard(t)
        busy[d].add(chosen)
        if with_w:
            for slot in range(chosen, t):
                level[d][slot] += delta
        else:
            walks[d].move(t, chosen, k)


def slot_levels(device_times: list[list[int]], deltas: Sequence[float]) -> list[float]:
    """One device's memory after each slot, every pass (W included) at its slot."""
    steps = [0.0] * (max(max(ts) for ts in device_times) + 1)
    for kind, ts in enumerate(device_times):
        for t in ts:
            steps[t] += deltas[kind]
    return list(accumulate(steps))


def earliest_fitting_slot(
    level: Sequence[float], busy: set[int], earliest: int, t: int, delta: float, limit: float
) -> int | None:
    """The first free slot in [earliest, t) a pass changing memory by `delta` can move to from
    `t` with the level (memory after each slot, W explicit) within `limit` over the slots it
    crosses; None if there is none. The feasible slots form a suffix of the range."""
    chosen, worst = None, -math.inf
    for slot in range(t - 1, earliest - 1, -1):
        worst = max(worst, level[slot])
        if delta > 0 and worst + delta > limit:
            break
        if slot not in busy:
            chosen = slot
    return chosen


class WalkedDevice:
    """One device's W placement (`_place_w`) and memory level, slot by slot, kept so that trying a
    pass in an earlier slot re-walks only from there until the walk rejoins the kept one (the
    same W pending, so the same levels on). The drain's squeeze tries every free slot of every
    late pass: placing all of a device's W again for each try made it quadratic in m."""

    def __init__(self, device_times: list[list[int]], deltas: list[float]):
        self.deltas = deltas
        horizon = max(max(ts) for ts in device_times[:4]) + 1
        self.kind_at = [-1] * horizon
        for kind in range(4):
            for t in device_times[kind]:
                self.kind_at[t] = kind
        self.pending = [(0, 0)] * (horizon + 1)
        """W of chunk 1 and of chunk 0 waiting before each slot."""
        self.level = [0.0] * (horizon + 1)
        """Memory before each slot. Past the last pass only W run, which free memory."""
        self._rewalk(0, horizon)

    def _step(self, kind: int, pending: tuple[int, int]) -> tuple[int, tuple[int, int]]:
        """The pass that runs in a slot holding `kind` (-1: free, a W if one waits) and what waits after."""
        up, down = pending
        if kind >= 0:
            return kind, (up + 1, down) if kind == _BU else (up, down + 1) if kind == _BD else pending
        if up:
            return _WU, (up - 1, down)
        if down:
            return _WD, (up, down - 1)
        return -1, pending

    def fits(self, t: int, slot: int, kind: int, limit: float) -> bool:
        """Whether the peak stays within `limit` with the pass of `kind` moved from `t` to `slot`."""
        if max(self.level[: slot + 1]) > limit:
            return False
        pending, level = self.pending[slot], self.level[slot]
        for x in range(slot, len(self.kind_at)):
            ran, pending = self._step(kind if x == slot else -1 if x == t else self.kind_at[x], pending)
            if ran >= 0:
                level += self.deltas[ran]
                if level > limit:
                    return False
            if x >= t and pending == self.pending[x + 1]:
                return max(self.level[x + 1 :]) <= limit
        return True

    def move(self, t: int, slot: int, kind: int) -> None:
        self.kind_at[slot], self.kind_at[t] = kind, -1
        self._rewalk(slot, t)

    def _rewalk(self, slot: int, t: int) -> None:
        """Walk again from `slot`, until past `t` the walk rejoins the kept one."""
        pending, level = self.pending[slot], self.level[slot]
        for x in range(slot, len(self.kind_at)):
            ran, pending = self._step(self.kind_at[x], pending)
            if ran >= 0:
                level += self.deltas[ran]
            if x >= t and pending == self.pending[x + 1]:
                return
            self.pending[x + 1], self.level[x + 1] = pending, level


def block_times(block: VBlock, m: int) -> list[list[list[int]]]:
    """The block repeated m times: per device, per pass, the slot of each micro-batch."""
    return [[[slot + PERIOD * j for j in range(m)] for slot in slots] for slots in block.slots]


def block_schedule(
    block: VBlock,
    m: int,
    deltas: list[list[float]],
    cap: Sequence[float],
    name: str | None = None,
) -> Schedule:
    """The block repeated for m micro-batches, warm-up and drain squeezed under `cap` (planned
    memory per device; `deltas[d]` from `chunk_deltas`), as per-device op orders.

    Two rounds, as in the paper: first warm-up and drain with W in their slots; then, W taken out
    and placed again afterwards, the drain once more."""
    p = block.num_devices
    times = block_times(block, m)
    for dev in times:
        _place_w(dev)
    steady_from, steady_to = times[0][_BD][0], times[0][_FD][m - 1]
    _squeeze(times, p, m, deltas, cap, range(6), lambda t: not steady_from <= t <= steady_to)
    times = [dev[:4] for dev in times]
    drain_from = times[0][_FD][m - 1]
    _squeeze(times, p, m, deltas, cap, range(4), lambda t: t > drain_from)
    for dev in times:
        _place_w(dev)
    return slot_schedule(name or block.name, times, p, m)


def slot_schedule(name: str, times: list[list[list[int]]], p: int, m: int) -> Schedule:
    """Each device's passes (F, F, B, B, W, W of chunk 0, 1, 1, 0, 1, 0) run in slot order."""
    devices = []
    for d, dev in enumerate(times):
        stages = (d, 2 * p - 1 - d)
        slotted = sorted((t, kind, j) for kind, ts in enumerate(dev) for j, t in enumerate(ts))
        devices.append([Op(_KIND[kind], stages[_UP[kind]], j) for _, kind, j in slotted])
    return Schedule.build(name, devices, num_stages=2 * p, num_microbatches=m)


def chunk_deltas(M_B: Sequence[float], M_W: Sequence[float], device: int, p: int, planned_M_W=None) -> list[float]:
    """`_deltas` for one device from per-stage tables; `planned_M_W` (fraction of M_B kept after B,
    or None for the real M_W) is the planning model."""
    down, up = device, 2 * p - 1 - device
    mb = (M_B[down], M_B[up])
    mw = (M_W[down], M_W[up]) if planned_M_W is None else (planned_M_W * mb[0], planned_M_W * mb[1])
    return _deltas(mb, mw)
