"""The V-shape greedy of "Pipeline Parallelism with Controllable Memory" (Qi et al. 2024, ZB-V).

Unlike `list_scheduler`, which lets the earliest free device decide, this greedy fills the V in
rounds that follow its shape, so its warm-up is planned rather than discovered:

1. warm-up: every device runs micro-batch 0's chunk-0 forward, then, from the turn back to device
   0, each device runs more chunk-0 forwards (on itself and every device above it) while memory
   and the time before its chunk-1 input arrives allow; devices then catch up on forwards,
   alternating chunks from the turn outwards;
2. steady state, one round per micro-batch and chunk: each device runs its next backward (the
   chunk whose input is there, chunk 1 first), then its next forward; a pending W runs first when
   it fits wholly in the wait for the op's input, or when the wait would exceed what the device
   may idle (the largest accumulated bubble of any device, less what it was allowed);
3. drain: the remaining W.

A device runs W whenever memory would not hold the next F or B. The per-device bubbles of one run
become the allowance ("approved bubble") of the next, which is iterated while the largest bubble
shrinks; four variants (whether W may fill before a chunk-0 B, before an F) are tried.

Chunk 0 of device d is stage d, chunk 1 stage 2p−1−d. Costs are per stage, so uneven stages keep
their own times; memory is per stage (M_B on F, M_W kept after B, freed by W).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from pipeloom.errors import InfeasibleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.stage_costs import StageCosts

__all__ = ["v_greedy", "warm_up_memory", "median_plan"]

_F, _B, _W = 0, 1, 2
_KINDS = (OpKind.F, OpKind.B, OpKind.W)


class _Run:
    """One greedy pass; `order` per device as (kind, stage, micro-batch)."""

    def __init__(self, p: int, m: int, table: StageCosts, limits: list[float], fill_b: bool, fill_f: bool, approved):
        self.p, self.m, self.t, self.limits = p, m, table, limits
        self.fill_b, self.fill_f = fill_b, fill_f
        self.approved = approved
        self.most_approved = max(approved) if approved else -1.0
        self.count = [[[0, 0] for _ in range(3)] for _ in range(p)]  # [device][kind][chunk]
        stages = 2 * p
        self.time = (table.F, table.B, table.W)
        self.deltas = tuple([table.delta_of(kind, s) for s in range(stages)] for kind in _KINDS)
        self.end = [[[-1.0] * m for _ in range(stages)] for _ in range(2)]  # [F/B][stage][mb] -> end time
        self.clock = [0.0] * p
        self.mem = [0.0] * p
        self.bubble = [0.0] * p
        self.last_w_end = -1.0
        """When the last device's last W of stage p−1 ended (-1: not yet): what the authors' code
        reads as the input time of an op that has none — it indexes its end times with the
        missing input's id, -1, which is that W's — so their W-filling rule does too here."""
        self.pending: list[deque] = [deque() for _ in range(p)]
        self.order: list[list[tuple[OpKind, int, int]]] = [[] for _ in range(p)]
        self.mattered: set[str] = set()
        """The variant switches (fill_b, fill_f) that changed a decision of this run."""

    def stage(self, d: int, chunk: int) -> int:
        return d if chunk == 0 else 2 * self.p - 1 - d

    def delta(self, kind: int, s: int) -> float:
        return self.deltas[kind][s]

    def input_end(self, kind: int, d: int, chunk: int, mb: int) -> float | None:
        """End time of the op on another device whose output this F or B needs (None: none, or
        on this device); -1 if it has not run."""
        p = self.p
        if kind == _F:
            src = d - 1 if chunk == 0 else d + 1
        else:  # backward runs from the last stage (chunk 1 on device 0) back
            src = d - 1 if chunk == 1 else d + 1
        if not 0 <= src < p:
            return None
        return self.end[kind][src if chunk == 0 else 2 * p - 1 - src][mb]

    def put(self, kind: int, d: int, chunk: int) -> None:
        """Run the device's next op of `kind` in `chunk` (the greedy's inner loop: written out
        flat, `input_end` and `_local_inputs_done` inlined)."""
        counts = self.count[d][kind]
        mb = counts[chunk]
        p = self.p
        s = d if chunk == 0 else 2 * p - 1 - d
        delta = self.deltas[kind][s]
        if mb >= self.m or self.mem[d] + delta > self.limits[d]:
            raise _Stuck
        end = self.end
        if kind == _F:
            if chunk == 1 and d == p - 1 and end[_F][s - 1][mb] < 0:
                raise _Stuck
            src = d - 1 if chunk == 0 else d + 1
        elif kind == _B:
            if end[_F][s][mb] < 0 or (chunk == 0 and d == p - 1 and end[_B][s + 1][mb] < 0):
                raise _Stuck
            src = d - 1 if chunk == 1 else d + 1
        else:
            if end[_B][s][mb] < 0:
                raise _Stuck
            src = -1
        time = self.time[kind][s]
        finish = no_wait = self.clock[d] + time  # rounded as the authors' code rounds it
        if 0 <= src < p:  # its input comes from another device
            arrival = end[kind][src if chunk == 0 else 2 * p - 1 - src][mb]
            if arrival < 0:
                raise _Stuck
            arrival = arrival + self.t.comm + time
            if arrival > finish:
                finish = arrival
        if self.count[d][_F][0]:
            self.bubble[d] += finish - no_wait
        self.clock[d] = finish
        if kind != _W:
            end[kind][s][mb] = finish
        elif chunk == 0 and d == p - 1 and mb == self.m - 1:  # their chunk 1: they number B's and W's from the turn
            self.last_w_end = finish
        self.mem[d] += delta
        self.order[d].append((_KINDS[kind], s, mb))
        counts[chunk] = mb + 1
        if kind == _B:
            self.pending[d].append(chunk)

    def put_w(self, d: int) -> None:
        self.put(_W, d, self.pending[d].popleft())

    def allowance(self, d: int) -> float:
        most = max(self.bubble)
        if self.approved:
            most = max(most, self.most_approved - self.approved[d])
        return most - self.bubble[d]

    def fill(self, d: int, arrival: float | None, eager: bool, switch: str | None) -> None:
        """W into the wait for an input (`arrival`: when it ended, -1 if not yet; None: the op
        has none): those that fit wholly, and one more if `eager` and the wait exceeds what the
        device may idle (`switch`: the variant switch that `eager` is). Without an input the
        wait is measured from `last_w_end`, as the authors' code measures it."""
        t, pending = self.t, self.pending[d]
        if arrival is not None:
            while pending and arrival >= 0 and arrival + t.comm >= self.clock[d] + t.W[self.stage(d, pending[0])]:
                self.put_w(d)
        else:
            arrival = self.last_w_end
        if pending and arrival + t.comm - self.clock[d] > self.allowance(d):
            if switch is not None:
                self.mattered.add(switch)
            if eager:
                self.put_w(d)

    def make_room(self, d: int, kind: int, chunk: int) -> None:
        while self.mem[d] + self.delta(kind, self.stage(d, chunk)) > self.limits[d]:
            if not self.pending[d]:
                raise _Stuck
            self.put_w(d)

    def run(self) -> None:
        self.warm_up()
        for _ in range(2 * self.m):
            self.backward_round()
            self.forward_round()
        for d in range(self.p):
            while self.pending[d]:
                self.put_w(d)

    def warm_up(self) -> None:
        """Forwards only, so the same for every variant and allowance."""
        p, m, t = self.p, self.m, self.t
        count = self.count
        for d in range(p):
            self.put(_F, d, 0)
        for d in range(p - 1, -1, -1):
            if d < p - 1:
                arrival = self.end[_F][self.stage(d + 1, 1)][0] + t.comm
                reserve = sum(t.M_B[self.stage(d, c)] for c in (0, 1))
                while (
                    self.mem[d] + (d + 1) * reserve <= self.limits[d]
                    and self.clock[d] + t.F[d] <= arrival
                    and count[d][_F][0] < m
                ):
                    for e in range(d + 1):
                        self.put(_F, e, 0)
            self.put(_F, d, 1)
        chunk = 0
        for d in range(1, p):
            fc, prev = count[d][_F], count[d - 1][_F]
            while fc[0] + fc[1] < prev[0] + prev[1] or fc[1] <= prev[1] < m:
                for e in range(p - 1, d - 1, -1):
                    if count[e][_F][chunk] < m:
                        self.put(_F, e, chunk)
                chunk = 1 - chunk

    def backward_round(self) -> None:
        p, m, count = self.p, self.m, self.count
        for d in range(p):
            self.make_room(d, _B, 0)
        first, second = [], []  # devices whose next B is of chunk 1 (the earlier), of chunk 0
        for d in range(p):
            b = count[d][_B]
            if b[0] >= b[1]:
                first.append(d)
            elif d == p - 1 or b[1] >= m or _has_run(self.input_end(_B, d, 0, b[0])):
                second.append(d)
            else:
                first.append(d)
        for d, chunk in [(d, 0) for d in reversed(second)] + [(d, 1) for d in first]:
            arrival = self.input_end(_B, d, chunk, count[d][_B][chunk])
            self.fill(d, arrival, chunk == 0 or self.fill_b, None if chunk == 0 else "fill_b")
            self.put(_B, d, chunk)

    def forward_round(self) -> None:
        p, m, count = self.p, self.m, self.count
        for d in range(p):
            f = count[d][_F]
            if f[1] >= m:
                continue
            if f[1] >= f[0]:
                chunk = 0
            elif d == p - 1 or self.end[_F][self.stage(d + 1, 1)][f[1]] >= 0:
                chunk = 1
            elif f[0] < m and (d == 0 or self.end[_F][d - 1][f[0]] >= 0):
                chunk = 0
            else:
                continue
            self.make_room(d, _F, chunk)
            arrival = self.input_end(_F, d, chunk, f[chunk])
            self.fill(d, arrival, self.fill_f, "fill_f")
            self.put(_F, d, chunk)


class _Stuck(Exception):
    """The greedy's rounds cannot go on under this memory limit."""


def _attempt(p, m, table, limits, fill_b, fill_f) -> tuple[_Run | None, set[str]]:
    """Runs iterated on their own bubbles while the largest one shrinks: the best run (None if
    the first is stuck) and the switches that changed a decision of any of them."""
    best, approved = None, None
    mattered: set[str] = set()
    while True:
        run = _Run(p, m, table, limits, fill_b, fill_f, approved)
        try:
            run.run()
        except _Stuck:
            return best, mattered | run.mattered
        mattered |= run.mattered
        worst = max(run.bubble)
        if best is not None and worst >= max(best.bubble):
            return best, mattered
        best, approved = run, list(run.bubble)


def v_greedy(name: str, p: int, m: int, table: StageCosts, limits: list[float]) -> Schedule:
    """The best of the greedy's four variants (smallest largest per-device bubble); InfeasibleError
    if none completes under `limits` (activation memory per device).

    Comparisons are exact, as the authors' code makes them, so that planned on the same costs
    this makes their schedule. A variant whose switch changed no decision of its twin with the
    switch on would repeat that twin, so it is not run."""
    best = None
    mattered: dict[tuple[bool, bool], set[str]] = {}
    for fill_b in (True, False):
        for fill_f in (True, False):
            twins = [((True, fill_f), "fill_b")] if not fill_b else []
            twins += [((fill_b, True), "fill_f")] if not fill_f else []
            twin = next((key for key, switch in twins if switch not in mattered[key]), None)
            if twin is not None:
                mattered[(fill_b, fill_f)] = mattered[twin]
                continue
            run, mattered[(fill_b, fill_f)] = _attempt(p, m, table, limits, fill_b, fill_f)
            if run is not None and (best is None or max(run.bubble) < max(best.bubble)):
                best = run
    if best is None:
        raise InfeasibleError(f"{name}: the V greedy cannot fill its rounds within the memory limit")
    devices = [[Op(kind, s, mb) for kind, s, mb in ops] for ops in best.order]
    return Schedule.build(name, devices, num_stages=2 * p, num_microbatches=m)


def warm_up_memory(p: int, m: int, table: StageCosts, limits: list[float]) -> list[float] | None:
    """Each device's activation memory at the end of the greedy's warm-up, which every run under
    `limits` shares, so no run's peak is below it; None if the warm-up does not fit."""
    run = _Run(p, m, table, limits, True, True, None)
    try:
        run.warm_up()
    except _Stuck:
        return None
    return run.mem


def median_plan(table: StageCosts, p: int) -> StageCosts:
    """The costs the authors' runtime plans its V on: each device's two chunks averaged, then the
    median device's (the upper one, as their code picks it) for every stage."""

    def median(values: list[float]) -> list[float]:
        per_device = sorted((values[d] + values[2 * p - 1 - d]) / 2 for d in range(p))
        return [per_device[p // 2]] * (2 * p)

    return replace(table, F=median(table.F), B=median(table.B), W=median(table.W))


def _has_run(end: float | None) -> bool:
    """Whether an op's input from another device is there (None: it needs none)."""
    return end is None or end >= 0
