"""Time intervals of a simulated step: when a device computes, idles or moves data.

Work beside the schedule (T-Offload's copies and host steps) is judged by where it falls: inside a
device's idle time it is free, under compute it contends with it, and on a link that p2p
transfers also use it slows while they run. These helpers answer those questions on sorted,
disjoint interval lists.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeloom.sim.simulate import Timeline

__all__ = ["Intervals", "merged", "idle_intervals", "link_transfers", "overlap", "finish_time"]

Intervals = list[tuple[float, float]]
"""Sorted, disjoint, non-empty (start, end) pairs."""

_EPS = 1e-12


def merged(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sort and join overlapping or touching intervals, dropping empty ones."""
    out: Intervals = []
    for start, end in sorted(i for i in intervals if i[1] - i[0] > _EPS):
        if out and start <= out[-1][1] + _EPS:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def idle_intervals(timeline: Timeline, device: int) -> Intervals:
    """When `device` runs no op, between the step's start and its makespan."""
    busy = merged((t.start, t.end) for t in timeline.timings(device))
    idle, at = [], 0.0
    for start, end in busy:
        if start > at + _EPS:
            idle.append((at, start))
        at = max(at, end)
    if timeline.makespan > at + _EPS:
        idle.append((at, timeline.makespan))
    return idle


def link_transfers(timeline: Timeline) -> tuple[list[Intervals], list[Intervals]]:
    """Per device: when a p2p transfer leaves it (sends) and when one arrives (receives). A
    dependency between devices occupies both ends' links for `comm` after its producer ends."""
    graph, comm = timeline.graph, timeline.costs.comm
    sends: list[list[tuple[float, float]]] = [[] for _ in range(timeline.num_devices)]
    receives: list[list[tuple[float, float]]] = [[] for _ in range(timeline.num_devices)]
    if comm > 0:
        for g, deps in enumerate(graph.deps):
            for dep in deps:
                if graph.device_of[dep] != graph.device_of[g]:
                    transfer = (timeline.end[dep], timeline.end[dep] + comm)
                    sends[graph.device_of[dep]].append(transfer)
                    receives[graph.device_of[g]].append(transfer)
    return [merged(s) for s in sends], [merged(r) for r in receives]


def overlap(start: float, end: float, intervals: Intervals) -> float:
    """Length of [start, end] that lies inside `intervals`."""
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals if b > start and a < end)


def finish_time(start: float, work: float, contended: Intervals, rate_inside: float) -> float:
    """When `work` (time at full rate) begun at `start` ends if it runs at `rate_inside` of its
    rate during `contended` and at full rate elsewhere (rate 0: it pauses)."""
    at, left = start, work
    for a, b in contended:
        if b <= at or left <= _EPS:
            continue
        if a > at:
            step = min(left, a - at)
            at, left = at + step, left - step
            if left <= _EPS:
                break
        if rate_inside > 0:
            step = min(left, (b - at) * rate_inside)
            at, left = at + step / rate_inside, left - step
        else:
            at = b
    return at + left
