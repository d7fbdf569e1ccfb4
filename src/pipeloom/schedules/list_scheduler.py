"""Zero Bubble's automatic scheduler (§3.1): greedy list scheduling of F, B, W under a memory limit.

The scheduler simulates the step as it builds it. The device whose clock is earliest decides its
next op; every op whose inputs are already placed has a known ready time, and every other op
cannot become ready before the earliest clock (its producer has not run yet), so "ready now" is
exact. Decisions, in order:

1. a B that is ready runs (B is on the critical path; among several, the earliest ready, then
   the deepest stage; but see `critical_first`);
2. else a ready F runs if memory allows. A new micro-batch enters a device (its first stage
   there) only if room remains for its later stages on that device too, so whatever has entered
   can finish: no memory deadlock, also when a device holds two stages (V-shapes). A device's
   first stage also runs at most as far ahead of its next stage as fits the time before that
   stage's first input arrives (the V warm-up);
3. else a pending W fills the gap if the gap is at least T_W (a lower bound on it, so the W
   delays no B), if the gap would make this device the one with the largest accumulated bubble
   (the paper's rule), or if memory blocks every F;
4. else the device waits for the next event. When F and B run out, the remaining W run.

Every op starts as soon as its device is free and its inputs have arrived, so the times kept
here are the simulator's. The binary hyper-parameters (`Heuristics`) switch individual rules
and each run records which of them changed a decision; `auto_search` searches them. Ops of one
stage and kind run in micro-batch order. The placement (stage → device) is free, so the same
code builds the linear ZB-1p/2p schedules and the V-shapes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field, fields

from pipeloom.errors import InfeasibleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["FLAGS", "Heuristics", "ListResult", "ListScheduler"]

_EPS = 1e-9
_F, _B, _W = OpKind.F, OpKind.B, OpKind.W


@dataclass(frozen=True, slots=True)
class Heuristics:
    """The auto-scheduler's binary hyper-parameters: the paper's two (§3.1: `eager_warmup`,
    `lazy_forward`), its small-gap rule as a switch, and ours. The last three matter only when a
    device holds several stages."""

    eager_warmup: bool = False
    """Before a device's first B, run another F even if it will delay that B."""
    lazy_forward: bool = False
    """Prefer a pending W to an F that the next stage already has two or more of."""
    unpaced: bool = False
    """Let a device's shallow stage run ahead of its deeper stage beyond the warm-up window."""
    loose_pacing: bool = False
    """Count a forward that only partly fits the warm-up window as fitting."""
    small_gap_rule: bool = True
    """The paper's rule: fill a gap shorter than T_W with a W when it would make this device's
    accumulated bubble the largest."""
    deepest_forward: bool = False
    """Among a device's ready forwards, run the deepest stage's rather than the earliest ready."""
    shallowest_backward: bool = False
    """Among a device's ready backwards, run the shallowest stage's (the one that completes a
    micro-batch on this device) rather than the earliest ready."""
    critical_first: bool = False
    """Run a ready F before a ready B when its micro-batch is further behind the steady-state template."""
    tail_reserve: bool = False
    """Keep, memory allowing, one pending W per device downstream for the gaps of the drain."""


FLAGS = tuple(f.name for f in fields(Heuristics))


@dataclass(frozen=True, slots=True)
class ListResult:
    name: str
    order: list[list[tuple]] = field(repr=False)
    """Per device, (kind, stage, micro-batch) in run order."""
    num_stages: int
    num_microbatches: int
    cost: float
    """Largest per-device span, as the simulator defines it."""
    peak: list[float]
    """Peak activation memory per device."""
    heuristics: Heuristics
    mattered: frozenset[str] = frozenset()
    """Flags whose value changed at least one decision of this run."""
    runs: int = 1
    """Greedy runs the search made."""

    @property
    def schedule(self) -> Schedule:
        devices = [[Op(kind, stage, mb) for kind, stage, mb in ops] for ops in self.order]
        return Schedule.build(self.name, devices, num_stages=self.num_stages, num_microbatches=self.num_microbatches)


class _Beaten(Exception):
    """A run that can no longer beat the best one found; `mattered`: the flags that changed one
    of its decisions before then (flipping any other replays it up to there, beaten alike)."""

    def __init__(self, mattered: frozenset[str]):
        super().__init__()
        self.mattered = mattered


class ListScheduler:
    """One greedy run (`run`). Flat per-(stage, micro-batch) tables, index stage * m + mb."""

    def __init__(self, name, placement, num_microbatches, table, limits, heuristics):
        self.name = name
        self.beaten_mattered: frozenset[str] = frozenset()
        self.placement = list(placement)
        self.m = num_microbatches
        self.t = table
        self.h = heuristics
        self.num_stages = S = len(placement)
        self.num_devices = P = max(placement) + 1
        self.limits = list(limits)
        self.stages_on = [[s for s in range(S) if placement[s] == d] for d in range(P)]
        self.comm_up = [table.comm if s and placement[s - 1] != placement[s] else 0.0 for s in range(S)]
        self.comm_down = [table.comm if s + 1 < S and placement[s + 1] != placement[s] else 0.0 for s in range(S)]
        # A forward is admitted for the most its micro-batch will hold of the stage: M_B, or M_W
        # once its B has run when a W keeps more than the activations it frees (M_W > M_B): a B
        # then never needs room a later forward took.
        self.admit = [max(table.M_B[s], table.M_W[s]) for s in range(S)]
        # A micro-batch entering a device's first stage must leave room for its later stages there.
        self.booking = [
            sum(self.admit[x] for x in self.stages_on[placement[s]] if x > s)
            if s == self.stages_on[placement[s]][0]
            else 0.0
            for s in range(S)
        ]
        self.drain_reserve = [
            len({placement[x] for x in range(max(self.stages_on[d], default=S) + 1, S)} - {d}) for d in range(P)
        ]
        # Pacing of a device's stages: stage s may run ahead of the device's next stage by the
        # number of its forwards that fit wholly (or, loosely, at all) before that stage's first
        # input can arrive.
        start = [0.0] * S
        for x in range(1, S):
            start[x] = start[x - 1] + table.F[x - 1] + self.comm_up[x]
        self.pace_next = [-1] * S
        self.pace_cap = [S * num_microbatches] * S
        for d in range(P):
            for here, after in zip(self.stages_on[d], self.stages_on[d][1:]):
                self.pace_next[here] = after
                if table.F[here]:
                    fits = (start[after] - start[here]) / table.F[here]
                    rounded = math.ceil(fits - _EPS) if heuristics.loose_pacing else math.floor(fits + _EPS)
                    self.pace_cap[here] = max(1, rounded)
        self.pacing_differs = any(
            table.F[here] and math.ceil(fits - _EPS) != math.floor(fits + _EPS)
            for d in range(P)
            for here, after in zip(self.stages_on[d], self.stages_on[d][1:])
            for fits in [(start[after] - start[here]) / table.F[here] if table.F[here] else 0.0]
        )
        # Uncongested path lengths, for lower bounds on when a B can become ready.
        self.reach_f = list(itertools.accumulate(self.comm_up[s] + (table.F[s] if s else 0.0) for s in range(S)))
        reach_b = [0.0] * S  # from the last F's end to the end of B(s)
        acc = 0.0
        for s in range(S - 1, -1, -1):
            acc += table.B[s] + (self.comm_down[s] if s < S - 1 else 0.0)
            reach_b[s] = acc
        self.reach_b = reach_b
        self.b_ready_offset = [reach_b[s + 1] + self.comm_down[s] if s + 1 < S else 0.0 for s in range(S)]
        # The steady-state template: micro-batch j's op at j·period + its uncongested offset.
        self.period = max(sum(table.F[x] + table.B[x] + table.W[x] for x in self.stages_on[d]) for d in range(P))
        self.template_f = start
        self.template_b = [start[S - 1] + table.F[S - 1] + self.b_ready_offset[x] for x in range(S)]

    # -- lower bounds -------------------------------------------------------------------------

    def _b_ready(self, s: int, j: int) -> tuple[float, bool]:
        """(time, exact): when B(s, j) is ready, or a lower bound if its inputs are not placed."""
        m, end_f, end_b = self.m, self.end_f, self.end_b
        if s == self.num_stages - 1:
            return end_f[s * m + j], True
        below = end_b[(s + 1) * m + j]
        if below >= 0:
            return max(end_f[s * m + j], below + self.comm_down[s]), True
        lowest_b = self.front_b[j]
        if lowest_b < self.num_stages:
            e = end_b[lowest_b * m + j]
            return e - self.reach_b[lowest_b] + self.b_ready_offset[s], False
        a = self.front_f[j]
        e = end_f[a * m + j]
        return e + self.reach_f[-1] - self.reach_f[a] + self.b_ready_offset[s], False

    # -- the run ------------------------------------------------------------------------------

    def run(self, bound: float = float("inf")) -> ListResult | None:
        """One greedy pass; None as soon as some device's span must exceed `bound`, and then
        `beaten_mattered` holds the flags that mattered until then."""
        try:
            return self._run(bound)
        except _Beaten as beaten:
            self.beaten_mattered = beaten.mattered
            return None

    def _run(self, bound: float) -> ListResult:
        S, m, P, t, h = self.num_stages, self.m, self.num_devices, self.t, self.h
        placement, stages_on, limits = self.placement, self.stages_on, self.limits
        booking, comm_up = self.booking, self.comm_up
        self.end_f = end_f = [-1.0] * (S * m)
        self.end_b = end_b = [-1.0] * (S * m)
        self.front_f = front_f = [-1] * m
        self.front_b = front_b = [S] * m
        nf, nb = [0] * S, [0] * S
        clock = [0.0] * P  # end of the device's last op
        first: list[float | None] = [None] * P
        mem, peak = [0.0] * P, [0.0] * P
        held, admit = [0.0] * P, self.admit  # memory as forwards are admitted: `admit` per forward
        bubble = [0.0] * P
        most_bubble = 0.0
        pending: list[deque] = [deque() for _ in range(P)]
        forwards_left = [m * len(stages_on[d]) for d in range(P)]
        left = [2 * m * len(stages_on[d]) for d in range(P)]
        out: list[list[tuple]] = [[] for _ in range(P)]  # (kind, stage, mb): Ops are built for the winner only
        b_done = [0] * P
        work_left = [sum(m * (t.F[s] + t.B[s] + t.W[s]) for s in stages_on[d]) for d in range(P)]
        bound += _EPS
        mattered: set[str] = set()
        min_f = min(t.F)
        # A device is in the heap with its decision time, or waiting (parked) for a producer;
        # `version` drops superseded heap entries.
        version = [0] * P
        waiting_since: list[float | None] = [None] * P
        heap = [(0.0, d, d, 0) for d in range(P) if stages_on[d]]
        heapq.heapify(heap)
        seq = itertools.count(P)
        inf = float("inf")

        def schedule_at(d: int, when: float) -> None:
            version[d] += 1
            heapq.heappush(heap, (when, next(seq), d, version[d]))

        def carry_on(d: int, when: float) -> tuple[float, int] | None:
            """Let d decide again at once if no other device is due earlier (saves the heap)."""
            if heap and heap[0][0] <= when:
                schedule_at(d, when)
                return None
            return when, d

        def wake(e: int) -> None:
            since = waiting_since[e]
            if since is not None:
                waiting_since[e] = None
                schedule_at(e, since)

        def place(d: int, op: tuple, ready: float, duration: float, delta: float) -> float:
            nonlocal most_bubble
            start = clock[d] if clock[d] > ready else ready
            began = first[d]
            if began is None:
                first[d] = began = start
            elif start > clock[d]:
                bubble[d] += start - clock[d]
                if bubble[d] > most_bubble:
                    most_bubble = bubble[d]
            out[d].append(op)
            mem[d] += delta
            if mem[d] > peak[d]:
                peak[d] = mem[d]
            kind, s = op[0], op[1]
            held[d] += admit[s] if kind == _F else t.M_W[s] - admit[s] if kind == _B else delta
            clock[d] = start + duration
            work_left[d] -= duration
            if clock[d] - began + work_left[d] > bound:
                raise _Beaten(frozenset(mattered))
            return clock[d]

        carried: tuple[float, int] | None = None
        while heap or carried:
            if carried is None:
                now, _, d, ver = heapq.heappop(heap)
                if ver != version[d]:
                    continue
            else:
                now, d = carried
                carried = None
            waiting_since[d] = None
            if left[d] == 0:  # drain: the remaining W, one by one
                while pending[d]:
                    s, j = pending[d].popleft()
                    place(d, (_W, s, j), 0.0, t.time_of(_W, s), t.delta_of(_W, s))
                continue
            # Candidates: the next B and the next F of each stage on the device.
            b_choice = f_choice = None
            next_event = next_exact = inf  # earliest ready time among the others: estimated / known
            f_blocked = False
            for s in stages_on[d]:
                j = nb[s]
                if j < nf[s]:
                    ready, exact = self._b_ready(s, j)
                    if exact and ready <= now + _EPS:
                        if b_choice is not None:
                            mattered.add("shallowest_backward")
                        if b_choice is None or (ready <= b_choice[0] + _EPS and not h.shallowest_backward):
                            b_choice = (ready, s, j)
                    else:
                        next_event = min(next_event, max(ready, now))
                        if exact:
                            next_exact = min(next_exact, ready)
                j = nf[s]
                if j < m and (s == 0 or end_f[(s - 1) * m + j] >= 0):
                    after = self.pace_next[s]
                    if after >= 0 and j - nf[after] >= self.pace_cap[s]:
                        mattered.add("unpaced")
                        if self.pacing_differs:
                            mattered.add("loose_pacing")
                        if not h.unpaced:
                            continue
                    if held[d] + admit[s] + booking[s] > limits[d] + _EPS:
                        f_blocked = True
                        continue
                    ready = end_f[(s - 1) * m + j] + comm_up[s] if s else 0.0
                    if ready <= now + _EPS:
                        if f_choice is not None:
                            mattered.add("deepest_forward")
                        if f_choice is None or h.deepest_forward or ready <= f_choice[0] + _EPS:
                            f_choice = (ready, s, j)
                    else:
                        next_event = min(next_event, ready)
                        next_exact = min(next_exact, ready)
            if b_choice is not None and f_choice is not None:
                # The op whose micro-batch is further behind the steady-state template is more urgent.
                late_f = f_choice[2] * self.period + self.template_f[f_choice[1]]
                late_b = b_choice[2] * self.period + self.template_b[b_choice[1]]
                if late_f < late_b - _EPS:
                    mattered.add("critical_first")
                    if h.critical_first:
                        b_choice = None
            if b_choice is not None:
                ready, s, j = b_choice
                end_b[s * m + j] = place(d, (_B, s, j), ready, t.time_of(_B, s), t.delta_of(_B, s))
                front_b[j] = s
                nb[s] += 1
                left[d] -= 1
                b_done[d] += 1
                pending[d].append((s, j))
                if s and placement[s - 1] != d:
                    wake(placement[s - 1])
                carried = carry_on(d, max(now, clock[d]))
                continue
            if f_choice is not None:
                ready, s, j = f_choice
                hold = False
                if b_done[d] == 0 and next_event < now + t.F[s] - _EPS:  # this F would delay the first B
                    mattered.add("eager_warmup")
                    hold = not h.eager_warmup
                if pending[d] and s + 1 < S and placement[s + 1] != d and nf[s] - nf[s + 1] >= 2:
                    mattered.add("lazy_forward")
                    hold = hold or h.lazy_forward
                if not hold:
                    end_f[s * m + j] = place(d, (_F, s, j), ready, t.time_of(_F, s), t.delta_of(_F, s))
                    front_f[j] = s
                    nf[s] += 1
                    left[d] -= 1
                    forwards_left[d] -= 1
                    if s + 1 < S and placement[s + 1] != d:
                        wake(placement[s + 1])
                    carried = carry_on(d, max(now, clock[d]))
                    continue
            if pending[d]:
                s, j = pending[d][0]
                horizon = next_event if next_event < inf else (heap[0][0] if heap else now) + min_f
                gap = horizon - max(now, clock[d])
                fill = f_choice is not None or gap >= t.W[s] - _EPS  # an F was held back for it, or W fits
                if not fill and bubble[d] + gap > most_bubble + _EPS:
                    mattered.add("small_gap_rule")
                    fill = h.small_gap_rule
                if fill and forwards_left[d] and len(pending[d]) <= self.drain_reserve[d]:
                    mattered.add("tail_reserve")
                    fill = not h.tail_reserve
                if fill or (f_blocked and b_choice is None):  # or recycle memory
                    pending[d].popleft()
                    place(d, (_W, s, j), 0.0, t.time_of(_W, s), t.delta_of(_W, s))
                    carried = carry_on(d, max(now, clock[d]))
                    continue
            # Nothing to run: wait for a known ready time, or for a producer to place an input.
            waiting_since[d] = now
            if next_exact < inf:
                schedule_at(d, next_exact)
            else:
                version[d] += 1  # parked until woken

        if any(left):
            stuck = [d for d in range(P) if left[d]]
            raise InfeasibleError(f"{self.name}: the greedy scheduler stalled on devices {stuck} (internal error)")
        spans = [clock[d] - began if (began := first[d]) is not None else 0.0 for d in range(P)]
        return ListResult(self.name, out, S, m, max(spans), peak, h, frozenset(mattered))
