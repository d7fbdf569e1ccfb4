"""Exact scheduling: Zero Bubble's ILP (appendix G) solved with OR-Tools CP-SAT.

Given where each stage runs, choose the order of every F, B and W on every device to minimise the
largest per-device span under a memory limit. Variables are op start times (integers after
scaling); each device's ops do not overlap; data dependencies carry `comm` across devices; the
activation memory of each device — F adds M_B, B adds M_W − M_B, W frees M_W, each at the op's
start — stays within the limit (a reservoir constraint, the ILP's (7)). Ops of one stage and kind
run in micro-batch order: they are interchangeable, so this loses no optimum and prunes
symmetric orders.

The heuristic schedule is a warm start (its order re-timed with the integer durations, so the
hint is feasible) and CP-SAT's lower bound gives the gap. OR-Tools is optional and imported here
only: ``pip install 'pipeloom[exact]'``.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, InfeasibleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["ExactResult", "solve_exact", "placement_of", "optimise_schedule"]

_F, _B, _W = OpKind.F, OpKind.B, OpKind.W
_TIME_RESOLUTION = 2000  # integer steps per shortest op
_MEMORY_RESOLUTION = 10**6  # integer steps per smallest memory amount: rounding stays negligible


@dataclass(frozen=True)
class ExactResult:
    schedule: Schedule
    cost: float
    """The solution's largest span, re-simulated with the real (unrounded) costs."""
    bound: float
    """CP-SAT's lower bound on the optimal span (rounded costs)."""
    gap: float
    """(objective − bound) / objective of the solver's model; 0 means proven optimal."""
    status: str
    wall_time: float
    hint_cost: float | None

    def summary(self) -> dict:
        return {
            "cost": self.cost,
            "bound": self.bound,
            "gap": self.gap,
            "status": self.status,
            "wall_time_s": self.wall_time,
            "hint_cost": self.hint_cost,
        }


def placement_of(schedule: Schedule) -> list[int]:
    """Stage → device of a schedule whose every stage runs on exactly one device."""
    where: dict[int, set[int]] = {}
    for device, _, op in schedule.ops():
        where.setdefault(op.stage, set()).add(device)
    replicated = sorted(s for s, devices in where.items() if len(devices) > 1)
    if replicated:
        raise ConfigError(
            f"exact mode needs each stage on one device; stage(s) {replicated} run on several (replicated pipelines)"
        )
    return [min(where[s]) for s in range(schedule.num_stages)]


def solve_exact(
    placement: Sequence[int],
    num_microbatches: int,
    costs: Costs,
    mem_limit: float | Sequence[float] | None = None,
    *,
    hint: Schedule | None = None,
    time_limit: float = 10.0,
    workers: int = 2,
    name: str = "exact",
    progress: Callable[[float, float | None], None] | None = None,
) -> ExactResult:
    """Optimise the op order for `placement` (stage → device) and return the best schedule found.

    `progress(seconds so far, best makespan so far or None)` is called a few times a second
    while CP-SAT searches, so a long solve shows it is alive and improving."""
    try:
        from ortools.sat.python import cp_model
    except ImportError:  # pragma: no cover - depends on the environment
        raise ConfigError("exact mode needs OR-Tools: pip install 'pipeloom[exact]' (or pip install ortools)") from None
    from pipeloom.schedules.auto_search import resolve_limits
    from pipeloom.sim.simulate import simulate

    if time_limit <= 0:
        raise ConfigError(f"exact: time limit must be positive, got {time_limit}")
    placement = list(placement)
    S, m = len(placement), num_microbatches
    P = max(placement) + 1
    table = costs.resolve(P, S)
    limits = resolve_limits(name, mem_limit, P, placement, table)
    for kind, values in (("F", table.F), ("B", table.B)):
        if min(values) <= 0:
            raise ConfigError(f"exact: {kind} times must be positive")

    durations = [d for d in (*table.F, *table.B, *table.W, costs.comm) if d > 0]
    time_scale = _TIME_RESOLUTION / min(durations)
    mems = [x for x in (*table.M_B, *table.M_W) if x > 0]
    mem_scale = _MEMORY_RESOLUTION / min(mems) if mems else 1.0

    def ticks(x: float) -> int:
        return int(round(x * time_scale))

    dur = {kind: [ticks(table.time_of(kind, i)) for i in range(len(table.F))] for kind in (_F, _B, _W)}
    comm = ticks(costs.comm)
    delta = {
        kind: [int(round(table.delta_of(kind, i) * mem_scale)) for i in range(len(table.M_B))] for kind in (_F, _B, _W)
    }
    horizon = sum(m * (dur[_F][s] + dur[_B][s] + dur[_W][s]) + 2 * comm for s in range(S)) * 2

    model = cp_model.CpModel()
    start: dict[tuple[OpKind, int, int], cp_model.IntVar] = {}
    end: dict[tuple[OpKind, int, int], cp_model.LinearExpr] = {}
    per_device: list[list[tuple[OpKind, int, int]]] = [[] for _ in range(P)]
    for s in range(S):
        for j in range(m):
            for kind in (_F, _B, _W):
                key = (kind, s, j)
                start[key] = model.new_int_var(0, horizon, f"{kind.value}{s}_{j}")
                end[key] = start[key] + dur[kind][s]
                per_device[placement[s]].append(key)

    def across(a: int, b: int) -> int:
        return comm if placement[a] != placement[b] else 0

    for s in range(S):
        for j in range(m):
            if s:
                model.add(start[(_F, s, j)] >= end[(_F, s - 1, j)] + across(s - 1, s))
            model.add(start[(_B, s, j)] >= end[(_F, s, j)])
            if s + 1 < S:
                model.add(start[(_B, s, j)] >= end[(_B, s + 1, j)] + across(s + 1, s))
            model.add(start[(_W, s, j)] >= end[(_B, s, j)])
            if j:
                for kind in (_F, _B, _W):
                    model.add(start[(kind, s, j)] >= end[(kind, s, j - 1)])

    # The ASAP timing the simulator uses starts each device with its first stage's first forward
    # as early as the forward chain allows; spans are measured from there.
    earliest = [0] * S
    for s in range(1, S):
        earliest[s] = earliest[s - 1] + dur[_F][s - 1] + across(s - 1, s)
    span = model.new_int_var(0, horizon, "span")
    for d in range(P):
        if not per_device[d]:
            continue
        first_stage = min(s for s in range(S) if placement[s] == d)
        origin = earliest[first_stage]
        model.add(start[(_F, first_stage, 0)] == origin)
        keys = per_device[d]
        model.add_no_overlap([model.new_interval_var(start[k], dur[k[0]][k[1]], end[k], f"i{k}") for k in keys])
        for k in keys:
            if k[0] is _W or (k[0] is _B and dur[_W][k[1]] == 0):
                model.add(span >= end[k] - origin)
        if limits[d] < math.inf:
            model.add_reservoir_constraint(
                [start[k] for k in keys], [delta[k[0]][k[1]] for k in keys], 0, int(limits[d] * mem_scale + 0.5)
            )
    model.minimize(span)

    hint_cost = None
    if hint is not None:
        hint_cost = simulate(hint, costs).cost
        scaled = Costs(
            F=[float(x) for x in dur[_F]],
            B=[float(x) for x in dur[_B]],
            W=[float(x) for x in dur[_W]],
            comm=float(comm),
        )
        timed = simulate(hint, scaled)
        for t in timed.timings():
            op = t.op
            if op.kind in (_F, _B, _W) and (op.kind, op.stage, op.microbatch) in start:
                model.add_hint(start[(op.kind, op.stage, op.microbatch)], int(round(t.start)))

    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = float(time_limit)
    solver.parameters.num_workers = max(1, int(workers))
    began = time.perf_counter()
    if progress is None:
        status = solver.solve(model)
    else:
        with _Ticker(progress, time_scale) as ticker:
            status = solver.solve(model, ticker.callback(cp_model))
    wall = time.perf_counter() - began
    status_name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        if status == cp_model.INFEASIBLE:
            raise InfeasibleError(f"{name}: no schedule fits the memory limit (CP-SAT proved it infeasible)")
        raise InfeasibleError(f"{name}: CP-SAT found no schedule within {time_limit:g} s (status {status_name})")

    devices = []
    for d in range(P):
        keys = sorted(per_device[d], key=lambda k: (solver.value(start[k]), k[0] is not _W))
        devices.append([Op(kind, s, j) for kind, s, j in keys])
    schedule = Schedule.build(name, devices, num_stages=S, num_microbatches=m)
    objective = solver.objective_value
    bound = solver.best_objective_bound
    return ExactResult(
        schedule=schedule,
        cost=simulate(schedule, costs).cost,
        bound=bound / time_scale,
        gap=(objective - bound) / objective if objective else 0.0,
        status=status_name,
        wall_time=wall,
        hint_cost=hint_cost,
    )


def optimise_schedule(
    schedule: Schedule,
    costs: Costs,
    mem_limit: float | Sequence[float] | None = None,
    *,
    time_limit: float = 10.0,
    progress: Callable[[float, float | None], None] | None = None,
) -> ExactResult:
    """Re-order `schedule`'s ops optimally on its own placement, warm-started from it.

    Fused backwards are split first (W right after B); the memory limit defaults to the
    schedule's own per-device peaks, so the result never needs more memory than its hint.
    """
    from pipeloom.passes.split_backward import split_backward
    from pipeloom.sim.simulate import simulate

    if any(op.overlap_next for _, _, op in schedule.ops()):
        raise ConfigError(
            "exact mode runs one op at a time: it cannot model overlapped F&B pairs (DualPipe's), whose two ops "
            "hide each other's communication, so its optimum would be slower than the paired schedule"
        )
    if any(op.kind is OpKind.BW for _, _, op in schedule.ops()):
        schedule = split_backward(schedule, "after")
    if any(op.kind is OpKind.R or op.slice or op.parts > 1 for _, _, op in schedule.ops()):
        raise ConfigError("exact mode orders F, B and W only: no checkpointing, slices or W parts")
    budget = mem_limit if mem_limit is not None else simulate(schedule, costs).peak_activation_memory
    return solve_exact(
        placement_of(schedule),
        schedule.num_microbatches,
        costs,
        budget,
        hint=schedule,
        time_limit=time_limit,
        name=f"{schedule.name}+exact",
        progress=progress,
    )


class _Ticker:
    """Reports the elapsed time and the best makespan found, from a thread, while CP-SAT runs."""

    def __init__(self, progress: Callable[[float, float | None], None], time_scale: float, every: float = 0.25):
        self.progress, self.time_scale, self.every = progress, time_scale, every
        self.best: float | None = None
        self.began = time.perf_counter()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)

    def callback(self, cp_model):
        ticker = self

        class OnSolution(cp_model.CpSolverSolutionCallback):
            def on_solution_callback(self) -> None:
                ticker.best = self.objective_value / ticker.time_scale

        return OnSolution()

    def _tick(self) -> None:
        while not self.done.wait(self.every):
            self.progress(time.perf_counter() - self.began, self.best)

    def __enter__(self) -> _Ticker:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()
        self.progress(time.perf_counter() - self.began, self.best)
