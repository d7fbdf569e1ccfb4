"""The dependency walk: every op as soon as its device is free and its inputs have arrived.

It is both the deadlock check of validation (with zero durations) and the simulator's timing
kernel, so it lives with the graph it walks and the IR needs nothing above it.

Each device is a queue; a device runs its head op when all of that op's dependencies have ended
(plus `comm` for an edge from another device), else it parks on the first missing one and is woken
when that op ends. Every op starts once and a device is woken at most once per dependency of
its head, so a run is linear in the number of ops; each op starts at the max of its device's
previous end and its inputs' arrivals, so the times do not depend on the order devices are
visited: the result is deterministic. If devices remain parked when nothing can run, the schedule deadlocks and the
parked ops form a cycle, which is reported. An overlapped pair's two ops start together, once
both ops' inputs are there, and both end when the two durations have passed (the simulator puts
the pair's whole cost on its first op).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.errors import ScheduleError
from pipeloom.ir.graph import DependencyGraph

__all__ = ["run"]


def run(
    graph: DependencyGraph, durations: Sequence[float], comm: float = 0.0, release: Sequence[float] | None = None
) -> tuple[list[float], list[float]]:
    """Start and end time of every op (flat index), or ScheduleError naming a deadlock cycle.

    `release[g]`, if given, is the earliest op g may start (an input from outside the schedule,
    such as a weight reload)."""
    num_ops = graph.num_ops
    deps, device_of, offsets, paired = graph.waits, graph.device_of, graph.offsets, graph.paired
    num_devices = len(offsets) - 1
    start = [0.0] * num_ops
    end = [-1.0] * num_ops  # -1: not run yet (durations are never negative)
    head = offsets[:-1]  # next flat op of each device
    free = [0.0] * num_devices
    parked: dict[int, list[int]] = {}  # op -> devices whose head waits for it
    runnable = list(range(num_devices - 1, -1, -1))
    while runnable:
        device = runnable.pop()
        g, stop, clock = head[device], offsets[device + 1], free[device]
        while g < stop:
            ready = clock if release is None or release[g] <= clock else release[g]
            for dep in deps[g]:
                arrival = end[dep]
                if arrival < 0:
                    parked.setdefault(dep, []).append(device)
                    break
                if device_of[dep] != device:
                    arrival += comm
                if arrival > ready:
                    ready = arrival
            else:
                start[g] = ready
                clock = ready + durations[g]
                if paired and g in paired:  # its partner starts with it; both end together
                    clock += durations[g + 1]
                    end[g] = clock
                    woken = parked.pop(g, None)
                    if woken:
                        runnable.extend(woken)
                    g += 1
                    start[g] = ready
                end[g] = clock
                woken = parked.pop(g, None)
                if woken:
                    runnable.extend(woken)
                g += 1
                continue
            break
        head[device], free[device] = g, clock
    stuck = [device for device in range(num_devices) if head[device] < offsets[device + 1]]
    if stuck:
        _raise_deadlock(graph, head, end, stuck[0])
    return start, end


def _raise_deadlock(graph: DependencyGraph, head: list[int], end: list[float], first: int) -> None:
    """Follow "head op waits for op X, which sits on a device whose head is ..." until it loops."""
    chain: list[tuple[int, int]] = []  # (parked head op, the op it waits for)
    position: dict[int, int] = {}
    device = first
    while device not in position:
        position[device] = len(chain)
        g = head[device]
        awaited = next(dep for dep in graph.waits[g] if end[dep] < 0)
        chain.append((g, awaited))
        device = graph.device_of[awaited]
    cycle = chain[position[device] :]
    clauses = []
    for g, awaited in cycle:
        blocker = head[graph.device_of[awaited]]
        clause = f"{graph.describe(g)} waits for {graph.describe(awaited)}"
        if blocker not in (awaited, g):
            clause += f", queued behind {graph.describe(blocker)}"
        clauses.append(clause)
    marks = {graph.locate(g) for pair in cycle for g in pair}
    schedule = graph.schedule
    raise ScheduleError(
        f"deadlock in schedule {schedule.name!r}: " + "; ".join(clauses),
        "cycle (data dependencies + device order):\n"
        + "\n".join(f"  {clause}" for clause in clauses)
        + "\n"
        + schedule.grid(marks),
    )
