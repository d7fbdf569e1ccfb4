"""The authors' V-Min and V-Half orders (Qi et al. 2024; their released `zbv_greedy`), re-expressed.

Our blocks (`v_blocks`) follow the same recipe — the paper's block repeated, warm-up and drain
squeezed under the block's memory — but differ in its details, and on some sizes the authors'
order is shorter (bench/v_frontier.py, +0.2 % at most). So their construction is kept as it is, a
candidate beside ours: it plans in unit slots with unit memory (an F holds one, a W frees one, a B
frees nothing), so it depends on p and m only and is built once per size.

Their steps, in slot terms:

1. the block repeated m times, every W placed in the first free slot after a B (one queue);
2. visiting every pass in slot order, the passes before device 0's first chunk-0 backward and
   after the last micro-batch's first forward move to the earliest free slot after their inputs
   where the device's memory stays within the largest any device held (W explicit);
3. the slots re-timed eagerly (each pass as early as its inputs and its device allow), W dropped;
4. step 2 again for the drain only, W placed afresh for every try (`v_blocks.WalkedDevice`);
5. re-timed, W placed per chunk, and each device's passes run in slot order.

Their reference recomputes a device's memory from scratch for every slot it tries, quadratic in
m; here a kept level (step 2) and a kept walk (step 4) make a try cost the slots it changes.
"""

from __future__ import annotations

from functools import lru_cache

from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.v_blocks import (
    WalkedDevice,
    earliest_fitting_slot,
    slot_levels,
    slot_schedule,
    v_half_block,
    v_min_block,
)

__all__ = ["authors_v_block", "forget"]

_FD, _FU, _BU, _BD, _W = range(5)  # their pass types; _W is any W while they are unnamed
_UNIT_MEMORY = (1, 1, 0, 0, -1)


def authors_v_block(name: str, p: int, m: int, which: str) -> Schedule:
    """Their V-Min (`which` "min") or V-Half ("half") order for p devices and m micro-batches."""
    schedule = _orders(p, m, which)
    return schedule if schedule.name == name else schedule.with_devices(schedule.devices, name=name)


@lru_cache(maxsize=32)
def _orders(p: int, m: int, which: str) -> Schedule:
    block = v_min_block(p) if which == "min" else v_half_block(p)
    times = [[[slot + 6 * j for j in range(m)] for slot in slots] for slots in block.slots]
    times = [dev + [_w_slots(dev)] for dev in times]
    levels = [slot_levels(dev, _UNIT_MEMORY) for dev in times]
    _reorder(times, p, m, max(max(level) for level in levels), explicit_w=True, levels=levels)
    times = [dev[:4] for dev in _retimed(times, p)]
    walks = [WalkedDevice(dev, [1, 1, 0, 0, -1, -1]) for dev in times]
    _reorder(times, p, m, max(max(walk.level) for walk in walks), explicit_w=False, walks=walks)
    times = [dev[:4] for dev in _retimed([dev + [_w_slots(dev)] for dev in times], p)]
    return slot_schedule(f"v-{which}", [_w_slots(dev, per_chunk=True) for dev in times], p, m)


def _w_slots(dev: list[list[int]], per_chunk: bool = False):
    """Each free slot takes a waiting W (chunk 1's first when `per_chunk`); the rest follow the
    last pass. One list of W slots, or `dev` with W of chunk 1 and of chunk 0 appended."""
    kind_at = {t: kind for kind in range(4) for t in dev[kind]}
    waiting = [0, 0]
    placed: list[list[int]] = [[], []]
    slot, last = 0, max(kind_at)
    while slot <= last or any(waiting):
        kind = kind_at.get(slot, -1)
        if kind in (_BU, _BD):
            waiting[kind - _BU if per_chunk else 0] += 1
        elif kind < 0:
            queue = next((q for q in (0, 1) if waiting[q]), None)
            if queue is not None:
                waiting[queue] -= 1
                placed[queue].append(slot)
        slot += 1
    return dev + placed if per_chunk else placed[0]


def _input_slot(times, p: int, d: int, kind: int, j: int) -> int:
    """The latest slot among the pass's inputs, its device's earlier pass of the same kind included."""
    dev = times[d]
    dep = -1
    if kind in (_FD, _BU) and d > 0:
        dep = times[d - 1][kind][j]
    elif kind in (_FU, _BD) and d + 1 < p:
        dep = times[d + 1][kind][j]
    if kind in (_FU, _BU, _BD):
        dep = max(dep, dev[kind - 1][j])
    if kind == _W:  # W are unnamed: the j-th W follows the j-th B of the device
        dep = max(dep, sorted(dev[_BU] + dev[_BD])[j])
    return max(dep, dev[kind][j - 1]) if j else dep


def _reorder(
    times,
    p: int,
    m: int,
    cap: float,
    explicit_w: bool,
    levels: list[list[float]] | None = None,
    walks: list[WalkedDevice] | None = None,
) -> None:
    """Their squeeze: passes in slot order; those of the warm-up (when W are explicit) and of
    the drain move to the earliest free slot after their inputs that keeps the device's peak
    within `cap`."""
    kinds = range(5 if explicit_w else 4)
    order = sorted((t, d, k, j) for d in range(p) for k in kinds for j, t in enumerate(times[d][k]))
    busy: list[set[int]] = [set() for _ in range(p)]
    phase = 0
    for t, d, k, j in order:
        if phase == 0 and k == _BD and d == 0:
            phase = 1
        if phase == 1:
            if k == _FD and j == m - 1:
                phase = 2
            busy[d].add(t)
            continue
        if phase == 0 and not explicit_w:
            busy[d].add(t)
            continue
        earliest = _input_slot(times, p, d, k, j) + 1
        chosen = t
        if explicit_w:
            assert levels is not None
            delta, level = _UNIT_MEMORY[k], levels[d]
            fitting = earliest_fitting_slot(level, busy[d], earliest, t, delta, cap)
            chosen = t if fitting is None else fitting
            for slot in range(chosen, t):
                level[slot] += delta
        else:
            assert walks is not None
            walk = walks[d]
            chosen = next((s for s in range(earliest, t) if s not in busy[d] and walk.fits(t, s, k, cap)), t)
            if chosen != t:
                walk.move(t, chosen, k)
        times[d][k][j] = chosen
        busy[d].add(chosen)


def _retimed(times, p: int):
    """Every pass as early as its inputs and its device's previous pass allow (unit time, in
    their visiting order: slot, device, kind, micro-batch)."""
    kinds = len(times[0])
    end: list[list[list[int]]] = [[[0] * len(times[d][k]) for k in range(kinds)] for d in range(p)]
    device_free = [0] * p
    visits = sorted((t, d, k, j) for d in range(p) for k in range(kinds) for j, t in enumerate(times[d][k]))
    for _, d, k, j in visits:
        ready = device_free[d]
        if k in (_FD, _BU) and d > 0:
            ready = max(ready, end[d - 1][k][j])
        elif k in (_FU, _BD) and d + 1 < p:
            ready = max(ready, end[d + 1][k][j])
        if 0 < k < 4:
            ready = max(ready, end[d][k - 1][j])
        if j:
            ready = max(ready, end[d][k][j - 1])
        end[d][k][j] = device_free[d] = ready + 1
    return [[[e - 1 for e in ends] for ends in dev] for dev in end]


def forget() -> None:
    """Drop the cached orders (`schedules.clear_caches`)."""
    _orders.cache_clear()
