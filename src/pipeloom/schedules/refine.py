"""Refining a schedule by filling its idle gaps, never later and never over a memory budget.

An op that fits wholly in an idle gap of its device (its inputs have arrived by the gap's start,
it ends by the next op's start) can move there: the ops it passes keep their start times, those
after it can only start earlier, and its consumers get their input sooner, so no op of the
schedule starts later and the span can only shrink. A move is taken only if the device's
activation memory, with the op's change counted earlier, stays within the budget. Sweeps repeat
with fresh times until nothing moves.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.sim.simulate import Timeline, simulate

__all__ = ["fill_gaps"]

_EPS = 1e-9


WINDOW = 24
"""Ops looked at after a gap: four micro-batches' worth of a V device's passes."""


def fill_gaps(timeline: Timeline, costs: Costs, budget: Sequence[float], sweeps: int = 8) -> Timeline:
    """`timeline`'s schedule after at most `sweeps` rounds of gap filling under `budget`
    (activation memory per device), timed under `costs` (those `timeline` was simulated on)."""
    schedule = timeline.schedule
    for _ in range(sweeps):
        devices, moved = _sweep(timeline, costs.comm, budget)
        if not moved:
            break
        timeline = simulate(schedule.with_devices(devices), costs)
    return timeline


def _sweep(timeline: Timeline, comm: float, budget: Sequence[float]) -> tuple[list[list], int]:
    graph, start, end, delta = timeline.graph, list(timeline.start), list(timeline.end), timeline.memory_delta
    deps, device_of = graph.deps, graph.device_of
    devices, moved = [], 0
    for d in range(timeline.schedule.num_devices):
        order = list(range(graph.offsets[d], graph.offsets[d + 1]))
        level = _levels(order, delta)
        limit = budget[d] + _EPS
        k = 1
        while k < len(order):
            gap_start, gap_end = end[order[k - 1]], start[order[k]]
            if gap_end - gap_start > _EPS:
                for i in range(k + 1, min(len(order), k + 1 + WINDOW)):
                    g = order[i]
                    duration = end[g] - start[g]
                    if duration > gap_end - gap_start + _EPS:
                        continue
                    ready = gap_start
                    for dep in deps[g]:
                        arrival = end[dep] + (comm if device_of[dep] != d else 0.0)
                        ready = max(ready, arrival)
                    if ready + duration > gap_end + _EPS:
                        continue
                    if delta[g] > 0 and max(level[k - 1 : i]) + delta[g] > limit:
                        continue
                    op = graph.ops[g]
                    if any(graph.ops[h].kind == op.kind and graph.ops[h].stage == op.stage for h in order[k:i]):
                        continue  # one stage's ops of a kind stay in micro-batch order (gradients sum in it)
                    order.insert(k, order.pop(i))
                    start[g], end[g] = ready, ready + duration
                    # g now comes before the ops it passed: only their levels change
                    level[k : i + 1] = [level[k - 1] + delta[g]] + [x + delta[g] for x in level[k:i]]
                    moved += 1
                    break
            k += 1
        devices.append([graph.ops[g] for g in order])
    return devices, moved


def _levels(order: list[int], delta: Sequence[float]) -> list[float]:
    """Memory after each op."""
    level, acc = [], 0.0
    for g in order:
        acc += delta[g]
        level.append(acc)
    return level
