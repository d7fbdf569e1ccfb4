"""One greedy run of SVPP's list scheduling (`svpp`), which simulates the step while it builds it:
the device due earliest picks its next op under a policy — which of a ready forward and backward
runs, a micro-batch's chunks in which order, how many forwards each device may hold.

Runs end early by exception: a deadlock (every device holds its forwards and waits for a
backward none can produce), a bound passed (the run cannot beat the best so far), or a device
over the activation room it was given.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from heapq import heappop, heappush

from pipeloom.costs import Costs
from pipeloom.ir.ops import Op, OpKind

__all__ = ["Policy", "SliceScheduler", "Deadlock", "Beaten", "Overflow"]

F, BW = OpKind.F, OpKind.BW
_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class Policy:
    prefer: str
    """"alternate", "forward" or "backward": which of a ready forward and backward runs."""
    deep_first: bool
    """Among one micro-batch's ready forwards, the later chunk first."""
    reserve: bool
    """Keep room for the remaining forwards of micro-batches that entered the device earlier."""
    taper: int = 0
    """Device d holds at most f − taper·d forwards (at least v·s): 1F1B's shape for taper 1."""


class Deadlock(Exception):
    """Every device holds f forwards and waits for a backward none can produce."""


class Beaten(Exception):
    """The run has passed the step length it had to beat."""


class Overflow(Exception):
    """A device holds more activations than the room it was given."""


class SliceScheduler:
    """One greedy run. Tables are flat, indexed by (stage * m + mb) * s + slice; a candidate is
    (ready time, priority, is forward, stage, mb, slice)."""

    def __init__(
        self,
        p: int,
        m: int,
        v: int,
        s: int,
        forwards: int,
        costs: Costs,
        policy: Policy,
        room: Sequence[float] | None = None,
    ):
        self.p, self.m, self.v, self.s = p, m, v, s
        self.S = S = v * p
        table = costs.resolve(p, S, s)
        self.t_forward = table.F
        self.t_backward = table.BW
        self.comm = table.comm
        self.activation = table.M_B
        self.room = room
        self.level = [0.0] * p  # activations held per device, as the simulator counts them
        self.policy = policy
        self.caps = [max(v * s, forwards - policy.taper * d) for d in range(p)]
        self.end_f = [-1.0] * (S * m * s)
        self.end_b = [-1.0] * (S * m * s)
        self.next_forward = [0] * S  # position in the stage's (mb, slice) order
        self.next_backward = [[s - 1] * m for _ in range(S)]  # per stage and mb: the slice to backward next
        self.lowest_open = [0] * S  # per stage: first micro-batch with backwards left
        self.held = [0] * p
        self.unrun_forwards = [[v * s] * m for _ in range(p)]

    def run(self, bound: float = math.inf) -> tuple[float, int, list[list[Op]]]:
        """Event-driven: the device due earliest acts (a heap of (time, device), ties to the
        lower device). A device's candidates change only when an op is placed on it or on a
        neighbour (whose stages feed or are fed by its own), so they are kept until then; a
        device with nothing ready sleeps until its earliest candidate is, or until a neighbour
        places an op (then it looks again at once). Entries of the heap that are no longer a
        device's due time are skipped."""
        p, S = self.p, self.S
        free = [0.0] * p  # when each device's last op ends
        due = [0.0] * p  # when each device acts next (inf: it waits on a neighbour)
        events = [(0.0, d) for d in range(p)]
        last_forward = [False] * p
        order: list[list[Op]] = [[] for _ in range(p)]
        left = [2 * self.v * self.m * self.s] * p
        work_left = self.work_per_device()
        stages_of = [range(d, S, p) for d in range(p)]
        neighbours = [sorted({(d - 1) % p, (d + 1) % p} - {d}) for d in range(p)]
        prefer = self.policy.prefer
        most_held = 0
        cached: list[list | None] = [None] * p
        earliest = [math.inf] * p  # the earliest ready time among a device's kept candidates
        while events:
            now, d = heappop(events)
            if now != due[d]:
                continue
            candidates = cached[d]
            if candidates is None:
                candidates = []
                for stage in stages_of[d]:
                    self.forward_candidate(stage, d, candidates)
                    self.backward_candidates(stage, candidates)
                cached[d] = candidates
                earliest[d] = min((c[0] for c in candidates), default=math.inf)
            if earliest[d] > now + _EPS:
                due[d] = earliest[d]
                if due[d] < math.inf:
                    heappush(events, (due[d], d))
                continue
            ready = [c for c in candidates if c[0] <= now + _EPS]
            forward_first = prefer == "forward" or (prefer == "alternate" and not last_forward[d])
            kinds = {c[2] for c in ready}
            is_forward = forward_first if len(kinds) == 2 else kinds.pop()
            _, _, _, stage, mb, slice_ = min((c for c in ready if c[2] == is_forward), key=lambda c: c[1])
            free[d] = end = self.place(is_forward, stage, mb, slice_, d, now)
            if is_forward and self.room is not None and self.level[d] > self.room[d] + _EPS:
                raise Overflow
            work_left[d] -= end - now
            if end + work_left[d] > bound + _EPS:
                raise Beaten  # the device's remaining ops alone end past the bound
            most_held = max(most_held, self.held[d])
            last_forward[d] = is_forward
            order[d].append(Op(F if is_forward else BW, stage, mb, slice_))
            left[d] -= 1
            cached[d] = None
            due[d] = end if left[d] else math.inf
            if left[d]:
                heappush(events, (end, d))
            for n in neighbours[d]:
                cached[n] = None
                if due[n] > free[n] and left[n]:  # asleep or waiting: look again now
                    due[n] = max(now, free[n])
                    heappush(events, (due[n], n))
        if any(left):
            raise Deadlock
        return max(free), most_held, order

    def work_per_device(self) -> list[float]:
        """Each device's total op time: no run can end before its clock plus what is left of it."""
        m, s, p = self.m, self.s, self.p
        work = [0.0] * p
        for stage in range(self.S):
            work[stage % p] += m * sum(
                self.t_forward[stage * s + slice_] + self.t_backward[stage * s + slice_] for slice_ in range(s)
            )
        return work

    def forward_candidate(self, stage: int, device: int, out: list) -> None:
        m, s = self.m, self.s
        position = self.next_forward[stage]
        if position >= m * s:
            return
        mb, slice_ = divmod(position, s)
        ready = 0.0
        if stage:
            arrival = self.end_f[((stage - 1) * m + mb) * s + slice_]
            if arrival < 0:
                return
            ready = arrival + (self.comm if (stage - 1) % self.p != device else 0.0)
        owed = 0
        if self.policy.reserve:
            started = self.unrun_forwards[device]
            owed = sum(started[j] for j in range(mb) if started[j] < self.v * s)
        if self.held[device] + 1 + owed > self.caps[device]:
            return
        chunk = stage // self.p
        out.append((ready, (mb, -chunk if self.policy.deep_first else chunk, slice_), True, stage, mb, slice_))

    def backward_candidates(self, stage: int, out: list) -> None:
        m, s = self.m, self.s
        end_f, end_b = self.end_f, self.end_b
        last_stage = stage == self.S - 1
        chunk = stage // self.p
        comm = self.comm if (stage + 1) % self.p != stage % self.p else 0.0
        next_backward = self.next_backward[stage]
        for mb in range(self.lowest_open[stage], m):
            slice_ = next_backward[mb]
            if slice_ < 0:
                continue
            k = (stage * m + mb) * s + slice_
            ready = end_f[k]
            if ready < 0:
                break  # forwards of a stage end in micro-batch order: later ones are not ready either
            if not last_stage:
                gradient = end_b[k + m * s]
                if gradient < 0:
                    continue
                ready = max(ready, gradient + comm)
            if slice_ < s - 1:
                ready = max(ready, end_b[k + 1])
            out.append((ready, (-chunk, -slice_, mb), False, stage, mb, slice_))

    def place(self, is_forward: bool, stage: int, mb: int, slice_: int, device: int, now: float) -> float:
        k = (stage * self.m + mb) * self.s + slice_
        if is_forward:
            end = now + self.t_forward[stage * self.s + slice_]
            self.end_f[k] = end
            self.level[device] += self.activation[stage * self.s + slice_]
            self.next_forward[stage] += 1
            self.held[device] += 1
            self.unrun_forwards[device][mb] -= 1
            return end
        end = now + self.t_backward[stage * self.s + slice_]
        self.end_b[k] = end
        self.level[device] -= self.activation[stage * self.s + slice_]
        self.next_backward[stage][mb] -= 1
        self.held[device] -= 1
        lowest, next_backward = self.lowest_open[stage], self.next_backward[stage]
        while lowest < self.m and next_backward[lowest] < 0:
            lowest += 1
        self.lowest_open[stage] = lowest
        return end
