"""The Zero Bubble authors' own scheduling heuristic, as their released code runs it.

`list_scheduler` is our reading of §3.1; the authors' code (`manual_order` in their repository)
makes different choices, and on some inputs better ones. So that zb-auto is never behind the
authors on the same input, their heuristic is one of its constructions, re-expressed here:

1. warm-up: micro-batch 0 runs forward on every stage. Walking back from the last stage, each
   stage gets as many extra forwards as memory allows and as fit before the first backward can
   reach it (`idle_before_first_b`: a forward may overrun that moment); a stage never warms up
   more than the one before it. Then micro-batch 0 runs backward from the last stage.
2. one round per later micro-batch: each stage decides whether to run its next forward
   (`prioritize_b`: a stage two or more forwards ahead of the next may skip it, when the next
   stage would otherwise wait); a stage only forwards if every later stage does. Before each F
   and each B, W that fit wholly in the wait for the input run first, and one more when the wait
   would exceed the largest bubble of any stage (or, with `no_bubble_greedy`, in any case); W
   also run whenever memory would not hold the next F or B. Stage 0 empties its W once its
   forwards are done.
3. drain: the remaining W.

Eight runs (the three switches) are made; a run whose backward would precede its forward, or
whose memory cannot be made to fit, is dropped, as in the authors' code. Their runtime plans on
the median stage's times (the `plan` table) and runs on the real ones: each run is timed on both,
its decisions on the plan and its result on `real`, so the same code gives their ZB heuristic as
their runtime uses it and as the exact costs would have it. A run that cannot beat `bound` (on
the real times) is abandoned.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.stage_costs import StageCosts

__all__ = ["HeuristicRun", "zb_heuristic", "median_table", "is_uniform"]

_EPS = 1e-9
_F, _B, _W = 0, 1, 2
_KINDS = (OpKind.F, OpKind.B, OpKind.W)
SWITCHES = ("idle_before_first_b", "prioritize_b", "no_bubble_greedy")


@dataclass(frozen=True, slots=True)
class HeuristicRun:
    order: list[list[tuple[int, int]]]
    """Per stage, (kind, micro-batch) in run order (kind 0 F, 1 B, 2 W)."""
    cost: float
    """Largest stage span on the real times."""

    def schedule(self, name: str, num_microbatches: int) -> Schedule:
        devices = [[Op(_KINDS[kind], stage, mb) for kind, mb in ops] for stage, ops in enumerate(self.order)]
        return Schedule.build(name, devices, num_stages=len(devices), num_microbatches=num_microbatches)


def median_table(table: StageCosts) -> StageCosts:
    """Every stage timed like the median one (the upper median, as the authors' runtime picks it)."""

    def upper(values: list[float]) -> list[float]:
        return [sorted(values)[len(values) // 2]] * len(values)

    return replace(table, F=upper(table.F), B=upper(table.B), W=upper(table.W))


class _Infeasible(Exception):
    """A run the authors' code would reject (memory cannot fit, or B before its F)."""


class _Beaten(Exception):
    """A run that can no longer beat the bound."""


class _Run:
    def __init__(self, m: int, plan: StageCosts, real: StageCosts, limits: Sequence[float], bound: float):
        p = len(plan.F)
        self.p, self.m, self.limits, self.comm, self.real_comm = p, m, limits, plan.comm, real.comm
        self.cost = (plan.F, plan.B, plan.W)
        self.real_cost = (real.F, real.B, real.W)
        self.delta = (
            [plan.M_B[s] for s in range(p)],
            [plan.M_W[s] - plan.M_B[s] for s in range(p)],
            [-w for w in plan.M_W],
        )
        self.count = [[0] * p for _ in range(3)]
        self.clock, self.real_clock = [0.0] * p, [0.0] * p
        self.first_start = [0.0] * p
        self.level, self.bubble = [0.0] * p, [0.0] * p
        self.end = [[[0.0] * m for _ in range(p)] for _ in range(2)]  # planned end of F / B
        self.real_end = [[[0.0] * m for _ in range(p)] for _ in range(2)] if plan is not real else self.end
        self.order: list[list[tuple[int, int]]] = [[] for _ in range(p)]
        self.bound = bound + _EPS
        self.dual = plan is not real
        self.most_bubble = 0.0
        self.work_left = [m * (real.F[s] + real.B[s] + real.W[s]) for s in range(p)]
        self.mattered: set[str] = set()

    def put(self, s: int, kind: int) -> None:
        count = self.count
        mb = count[kind][s]
        clock = self.clock[s]
        ready = clock
        real_ready = self.real_clock[s]
        if kind == _F:
            if s > 0:
                ready = max(clock, self.end[_F][s - 1][mb] + self.comm)
                if self.dual:
                    real_ready = max(self.real_clock[s], self.real_end[_F][s - 1][mb] + self.real_comm)
        elif kind == _B:
            if count[_F][s] <= mb:
                raise _Infeasible
            if s < self.p - 1:
                ready = max(clock, self.end[_B][s + 1][mb] + self.comm)
                if self.dual:
                    real_ready = max(self.real_clock[s], self.real_end[_B][s + 1][mb] + self.real_comm)
        if not self.dual:
            real_ready = ready
        if count[_F][s]:
            bubble = self.bubble[s] + ready - clock
            self.bubble[s] = bubble
            if bubble > self.most_bubble:
                self.most_bubble = bubble
        else:
            self.first_start[s] = real_ready
        self.clock[s] = clock = ready + self.cost[kind][s]
        real_end = real_ready + self.real_cost[kind][s] if self.dual else clock
        self.real_clock[s] = real_end
        left = self.work_left[s] - self.real_cost[kind][s]
        self.work_left[s] = left
        if real_end - self.first_start[s] + left > self.bound:
            raise _Beaten
        if kind != _W:
            self.end[kind][s][mb] = clock
            self.real_end[kind][s][mb] = real_end
        self.level[s] += self.delta[kind][s]
        count[kind][s] = mb + 1
        self.order[s].append((kind, mb))

    def make_room(self, s: int, kind: int) -> None:
        while self.level[s] + self.delta[kind][s] > self.limits[s] + _EPS:
            if self.count[_W][s] >= self.count[_B][s]:
                raise _Infeasible
            self.put(s, _W)

    def fill(self, s: int, arrival: float, greedy: bool) -> None:
        """W into the wait for an input arriving at `arrival` (planned)."""
        W, count = self.cost[_W][s], self.count
        while count[_W][s] < count[_B][s] and self.clock[s] + W <= arrival:
            self.put(s, _W)
        if count[_W][s] < count[_B][s] and self.clock[s] < arrival:
            if arrival - self.clock[s] <= self.most_bubble - self.bubble[s]:
                self.mattered.add("no_bubble_greedy")
                if greedy:
                    self.put(s, _W)
            else:
                self.put(s, _W)

    def warm_up(self, idle_before_first_b: bool) -> None:
        p, m, F, B = self.p, self.m, self.cost[_F], self.cost[_B]
        for s in range(p):
            self.put(s, _F)
        extra = [0] * p
        last = self.end[_F][p - 1][0] + B[p - 1]
        for s in range(p - 2, -1, -1):
            level, clock = self.level[s], self.clock[s]
            while self.count[_F][s] + extra[s] < m and level + self.delta[_F][s] <= self.limits[s] + _EPS:
                overruns = clock + F[s] > last + self.comm
                if overruns != (clock >= last + self.comm):
                    self.mattered.add("idle_before_first_b")
                if overruns if idle_before_first_b else clock >= last + self.comm:
                    break
                level += self.delta[_F][s]
                clock += F[s]
                extra[s] += 1
            last = max(clock, last + self.comm) + B[s]
        for s in range(1, p):
            while extra[s] > 0 and extra[s] >= extra[s - 1] and self.count[_F][s] + extra[s] < m:
                extra[s] -= 1
        for s in range(p):
            for _ in range(extra[s]):
                self.put(s, _F)
        for s in range(p - 1, -1, -1):
            self.make_room(s, _B)  # only when M_W > M_B, which the authors' code does not check
            self.put(s, _B)

    def wants_forward(self, s: int, prioritize_b: bool) -> bool:
        count, F, B = self.count, self.cost[_F], self.cost[_B]
        if count[_F][s] >= self.m:
            return False
        if s + 1 < self.p and count[_F][s] >= count[_F][s + 1] + 2:
            self.mattered.add("prioritize_b")
            if prioritize_b:
                nxt = s + 1
                next_ready = self.clock[nxt] + F[nxt] + B[nxt] + self.comm
                if self.clock[s] >= next_ready:
                    return False
                level, w_cost, w = self.level[s] + self.delta[_F][s], 0.0, count[_W][s]
                while level > self.limits[s] + _EPS and w < count[_B][s]:
                    w_cost += self.cost[_W][s]
                    level += self.delta[_W][s]
                    w += 1
                if self.clock[s] + F[s] + w_cost <= next_ready:
                    return True
                return next_ready - self.clock[s] > self.most_bubble - self.bubble[s]
        return True

    def rounds(self, prioritize_b: bool, no_bubble_greedy: bool) -> None:
        p, m, count, end, comm = self.p, self.m, self.count, self.end, self.comm
        for i in range(1, m):
            forward = [self.wants_forward(s, prioritize_b) for s in range(p)]
            for s in range(p - 2, -1, -1):
                forward[s] = forward[s] and forward[s + 1]
            for s in range(p):
                if forward[s]:
                    self.make_room(s, _F)
                    if s > 0:
                        self.fill(s, end[_F][s - 1][count[_F][s]] + comm, no_bubble_greedy)
                    self.put(s, _F)
            for s in range(p - 1, -1, -1):
                self.make_room(s, _B)
                if s + 1 < p:
                    self.fill(s, end[_B][s + 1][i] + comm, no_bubble_greedy)
                if s == 0 and count[_F][0] == m:
                    while count[_W][0] < count[_B][0]:
                        self.put(0, _W)
                self.put(s, _B)
        for s in range(p):
            while count[_W][s] < m:
                self.put(s, _W)
        if any(count[_F][s] < m for s in range(p)):
            raise _Infeasible

    def span(self) -> float:
        return max(self.real_clock[s] - self.first_start[s] for s in range(self.p))


def zb_heuristic(
    m: int, plan: StageCosts, real: StageCosts, limits: Sequence[float], bound: float = math.inf
) -> HeuristicRun | None:
    """The best of the authors' eight runs on p stages (one per device) under `limits`
    (activation memory per stage), decided on `plan`, timed on `real`; None if every run is
    infeasible or none beats `bound`. A switch that changed no decision of a run is not flipped
    (the flipped run would repeat it)."""
    best: HeuristicRun | None = None
    mattered: dict[tuple[bool, ...], set[str]] = {}
    for values in itertools.product((True, False), repeat=len(SWITCHES)):  # every switch on first
        twin = next(
            (
                _with(values, k)
                for k, name in enumerate(SWITCHES)
                if not values[k] and name not in mattered[_with(values, k)]
            ),
            None,
        )
        if twin is not None:  # the same decisions as the run with that switch on
            mattered[values] = mattered[twin]
            continue
        switches = dict(zip(SWITCHES, values))
        run = _Run(m, plan, real, limits, best.cost if best else bound)
        try:
            run.warm_up(switches["idle_before_first_b"])
            run.rounds(switches["prioritize_b"], switches["no_bubble_greedy"])
        except (_Infeasible, _Beaten):
            continue  # a run cut short decided as its twins would up to there: they end the same
        finally:
            mattered[values] = run.mattered
        cost = run.span()
        if best is None or cost < best.cost - _EPS:
            best = HeuristicRun(run.order, cost)
    return best


def _with(values: tuple[bool, ...], k: int) -> tuple[bool, ...]:
    return values[:k] + (True,) + values[k + 1 :]


def is_uniform(table: StageCosts) -> bool:
    """Every stage timed alike: the median plan is the exact one."""
    return all(len(set(values)) == 1 for values in (table.F, table.B, table.W))
