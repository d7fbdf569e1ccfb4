"""Simulate a schedule under costs: times, memory, and the metrics that compare schedules (docs/design.md §3).

Definitions (Zero Bubble paper, §2 and §5):

* makespan — first op start to last op end over all devices;
* span of a device — its first op start to its last op end; ``cost`` = the largest span;
* useful work of a device — the time of its F, B, W and BW ops (recompute is overhead);
* ``bubble_rate = (cost − mean useful work per device) / cost``; with identical devices this is
  the paper's ``(cost − m·(T_F+T_B+T_W)) / cost``.

Memory changes only by a device's own ops, which run one at a time: an op's allocation counts
from its start, its release from its end (docs/design.md §2 for the amounts).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from itertools import compress

from pipeloom.costs import Costs
from pipeloom.ir.graph import DependencyGraph, build_graph
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.walk import run
from pipeloom.stage_costs import StageCosts
from pipeloom.units import memory_unit, time_unit

__all__ = ["Timeline", "simulate", "OpTiming"]

_USEFUL = (OpKind.F, OpKind.B, OpKind.W, OpKind.BW)


@dataclass(frozen=True, slots=True)
class OpTiming:
    device: int
    step: int
    op: Op
    start: float
    end: float


@dataclass(frozen=True)
class Timeline:
    """The outcome of one simulation. Per-op data is in flat lists ordered device by device."""

    schedule: Schedule
    costs: Costs
    graph: DependencyGraph = field(repr=False)
    start: list[float] = field(repr=False)
    end: list[float] = field(repr=False)
    memory_delta: list[float] = field(repr=False)
    makespan: float
    cost: float
    bubble_rate: float
    spans: list[float]
    useful_time: list[float]
    busy_time: list[float]
    static_memory: list[float]
    peak_activation_memory: list[float]

    @property
    def peak_memory(self) -> list[float]:
        """Per device: static memory plus the activation peak."""
        return [s + a for s, a in zip(self.static_memory, self.peak_activation_memory)]

    @property
    def num_devices(self) -> int:
        return self.schedule.num_devices

    def device_idle_shares(self) -> list[float]:
        """Per device: the share of its own span in which it does no useful work (waiting, or
        recomputing). A device busy from its first op to its last has none, whatever the others do."""
        return [(span - useful) / span if span else 0.0 for span, useful in zip(self.spans, self.useful_time)]

    def timings(self, device: int | None = None) -> Iterator[OpTiming]:
        """Every op (of one device, or all) with its start and end, in device order."""
        devices = range(self.num_devices) if device is None else (device,)
        offsets = self.graph.offsets
        for d in devices:
            for g in range(offsets[d], offsets[d + 1]):
                yield OpTiming(d, g - offsets[d], self.graph.ops[g], self.start[g], self.end[g])

    def interval(self, device: int, step: int) -> tuple[float, float]:
        g = self.graph.offsets[device] + step
        return self.start[g], self.end[g]

    def memory_curve(self, device: int) -> list[tuple[float, float]]:
        """(time, memory) breakpoints of a device, static memory included; a step function."""
        level = self.static_memory[device]
        points = [(0.0, level)]
        offsets = self.graph.offsets
        for g in range(offsets[device], offsets[device + 1]):
            delta = self.memory_delta[g]
            if delta:
                level += delta
                points.append((self.start[g] if delta > 0 else self.end[g], level))
        return points

    def summary(self) -> dict:
        """The figures a report or `--json` needs; `time_unit` and `memory_unit` say what the
        times (makespan, cost, spans, useful_time) and memories are in."""
        return {
            "name": self.schedule.name,
            "num_devices": self.schedule.num_devices,
            "num_stages": self.schedule.num_stages,
            "num_microbatches": self.schedule.num_microbatches,
            "num_slices": self.schedule.num_slices,
            "num_ops": self.graph.num_ops,
            "makespan": self.makespan,
            "cost": self.cost,
            "bubble_rate": self.bubble_rate,
            "peak_memory": self.peak_memory,
            "peak_activation_memory": self.peak_activation_memory,
            "static_memory": self.static_memory,
            "spans": self.spans,
            "useful_time": self.useful_time,
            "device_idle_share": self.device_idle_shares(),
            "time_unit": time_unit(self.costs),
            "memory_unit": memory_unit(self.costs),
        }


def simulate(schedule: Schedule, costs: Costs | None = None, not_before: Mapping[Op, float] | None = None) -> Timeline:
    """Time and memory of `schedule` under `costs` (default: F=1, B=2, W=0, M_B=1).

    `not_before` holds the earliest start of some ops, for inputs from outside the schedule (a
    weight reload). Raises ScheduleError for an invalid schedule (the simulation is also the
    deadlock check).
    """
    costs = costs if costs is not None else Costs()
    graph = build_graph(schedule)
    table = costs.resolve(schedule.num_devices, schedule.num_stages, schedule.num_slices)
    durations, deltas = _op_costs(graph, table)
    release = [not_before.get(op, 0.0) for op in graph.ops] if not_before else None
    start, end = run(graph, durations, costs.comm, release)
    offsets = graph.offsets
    num_devices = schedule.num_devices
    counted = [op.kind in _USEFUL for op in graph.ops]  # recomputes (R) are not useful work

    spans, useful, busy, peaks = [], [], [], []
    last_end = 0.0
    for d in range(num_devices):
        first, stop = offsets[d], offsets[d + 1]
        if first == stop:
            spans.append(0.0)
            useful.append(0.0)
            busy.append(0.0)
            peaks.append(0.0)
            continue
        spans.append(end[stop - 1] - start[first])
        last_end = max(last_end, end[stop - 1])
        useful.append(sum(compress(durations[first:stop], counted[first:stop])))
        busy.append(sum(durations[first:stop]))
        peaks.append(_peak(deltas, first, stop, graph.paired))
    cost = max(spans)
    mean_useful = sum(useful) / num_devices
    static = [
        sum(table.M_static[stage] for stage in schedule.stages_on(d))
        - costs.shared_static(schedule.stages_on(d), schedule.num_stages)
        for d in range(num_devices)
    ]
    return Timeline(
        schedule=schedule,
        costs=costs,
        graph=graph,
        start=start,
        end=end,
        memory_delta=deltas,
        makespan=last_end,  # some op always starts at 0: the first one with no inputs
        cost=cost,
        # a device's useful time lies within its span: below 0 is rounding ("-0.00%" in reports)
        bubble_rate=max(0.0, (cost - mean_useful) / cost) if cost else 0.0,
        spans=spans,
        useful_time=useful,
        busy_time=busy,
        static_memory=static,
        peak_activation_memory=peaks,
    )


def _op_costs(graph: DependencyGraph, table: StageCosts) -> tuple[list[float], list[float]]:
    """Duration and memory change of every op, by flat index."""
    time_of, delta_of, num_slices = table.time_of, table.delta_of, table.num_slices
    forward_only = graph.schedule.forward_only  # a forward keeps nothing for a backward
    durations: list[float] = []
    deltas: list[float] = []
    known: dict[tuple, tuple[float, float]] = {}  # micro-batches repeat a stage's few distinct ops
    # the forwards of micro-batches whose backward is fused run as F_BW (where it is priced apart)
    fused = {op.key for op in graph.ops if op.kind is OpKind.BW} if table.F_BW is not table.F else set()
    for op in graph.ops:
        i = op.stage * num_slices + op.slice
        kind = op.kind
        key = (kind, i, op.ckpt, op.parts, kind is OpKind.F and op.key in fused)
        costs = known.get(key)
        if costs is None:
            time = table.F_BW[i] if key[-1] else time_of(kind, i, op.parts)
            costs = known[key] = (time, delta_of(kind, i, op.ckpt, op.parts))
        durations.append(costs[0])
        deltas.append(0.0 if forward_only else costs[1])
    for g in graph.paired:  # the pair's whole time on its first op (the walk adds the two)
        first, second = graph.ops[g], graph.ops[g + 1]
        forward, backward = (first, second) if first.kind is OpKind.F else (second, first)
        durations[g] = table.pair_time(
            table.index(forward), table.index(backward), backward.kind is OpKind.BW, forward.key in fused
        )
        durations[g + 1] = 0.0
    return durations, deltas


def _peak(deltas: list[float], first: int, stop: int, paired: frozenset[int] = frozenset()) -> float:
    """The most a device holds. An overlapped pair's two ops run at once, so while it runs the
    device holds what either allocates before what either frees: a backward-first pair (B;F)
    holds its F's activations while its B's are still there."""
    level = peak = 0.0
    for g in range(first, stop):
        if g in paired:
            during = level + max(deltas[g], 0.0) + max(deltas[g + 1], 0.0)
            if during > peak:
                peak = during
        level += deltas[g]
        if level > peak:
            peak = level
    return peak
