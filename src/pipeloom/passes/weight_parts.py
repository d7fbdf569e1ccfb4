"""Fine-grained weight gradients (MEPipe §5): W cut into its GEMMs, each run where its device waits.

Weight gradients of different matrices do not depend on each other, so a stage's W can be cut
into one part per weight matrix. The pass keeps every device's order of F, B and R and re-places
the W parts by simulating the step: a device whose next op is not ready yet runs a queued part
(the oldest first); a part is short, so it overruns the wait by little. A device runs parts
before its next op also when that op would exceed its memory limit, since a pending W holds M_W.
Devices below the limit defer the rest to the end of the step, where the drain leaves room; the
default limit is the schedule's own largest per-device peak, so the devices that use less can
defer more (Fig. 7). Three policies are simulated — a part whenever the next op is not ready, a
part only where it ends before the next op is ready, every part right after its B — and, if the
input already placed its W, that placement with each W cut in place; the shortest step is kept.

Fused BW ops are split first; existing W ops (any parts) are re-cut.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from heapq import heappop, heappush

from pipeloom.budget import per_device
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.graph import build_graph
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import simulate

__all__ = ["weight_parts", "DEFAULT_PARTS"]

DEFAULT_PARTS = 7
"""Weight matrices of one LLaMA layer: q, k, v, o, gate, up, down."""

_F, _R, _B, _W, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.W, OpKind.BW
_EPS = 1e-9
_POLICIES = ("wait", "fit", "eager")
"""When a device runs a queued part before its next op (besides the drain and memory):
whenever that op is not ready yet; only if the part ends before the op is ready; always."""


def weight_parts(
    schedule: Schedule,
    costs: Costs,
    parts: int = DEFAULT_PARTS,
    mem_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """`schedule` with every W in `parts` parts placed into the waits (see the module docstring).

    >>> from pipeloom.schedules import build_schedule
    >>> s = weight_parts(build_schedule("1f1b", 2, 1), Costs(F=1, B=1, W=1), parts=2)
    >>> s.to_text().splitlines()[1:]
    ['0F0 0B0 0W0:0/2 0W0:1/2', '1F0 1B0 1W0:0/2 1W0:1/2']
    """
    if not isinstance(parts, int) or isinstance(parts, bool) or parts < 1:
        raise ConfigError(f"weight_parts: parts must be a positive integer, got {parts!r}")
    fused = _fused(schedule)
    limits = _limits(schedule, costs, mem_limit)
    name = f"{schedule.name}+wparts"
    placed = []  # (makespan, schedule), in the order ties are broken
    for policy in _POLICIES:
        placer = _Placer(fused, costs, parts, limits, policy)
        devices = placer.run()
        candidate = schedule.with_devices(devices, name)
        # The placer simulated the step as it built it; overlapped pairs it does not model.
        makespan = placer.makespan if not placer.graph.paired else simulate(candidate, costs).makespan
        placed.append((makespan, candidate))
    if any(op.kind is _W for _, _, op in schedule.ops()):
        candidate = schedule.with_devices(_recut_in_place(schedule, parts), name)
        placed.append((simulate(candidate, costs).makespan, candidate))
    return min(placed, key=lambda item: item[0])[1]


def _recut_in_place(schedule: Schedule, parts: int) -> list[list[Op]]:
    """The input's own W placement, each W as its parts in a row: never worse than the input."""
    devices = []
    for ops in schedule.devices:
        out: list[Op] = []
        for op in ops:
            if op.kind is not _W:
                out.append(op)
            elif op.part == 0:
                out += [Op(_W, op.stage, op.microbatch, op.slice, part=i, parts=parts) for i in range(parts)]
        devices.append(out)
    return devices


def _fused(schedule: Schedule) -> Schedule:
    """The same order with every backward as one BW and no W: the dependency skeleton."""
    devices = [
        [Op(_BW, op.stage, op.microbatch, op.slice) if op.kind is _B else op for op in ops if op.kind is not _W]
        for ops in schedule.devices
    ]
    return schedule.with_devices(devices)


def _limits(schedule: Schedule, costs: Costs, mem_limit) -> list[float]:
    p = schedule.num_devices
    if mem_limit is None:
        return [max(simulate(schedule, costs).peak_activation_memory)] * p
    return per_device(mem_limit, p, "weight_parts")


class _Placer:
    """One simulated step; op g is the g-th op of the fused skeleton (its BW stands for the B)."""

    def __init__(self, fused: Schedule, costs: Costs, parts: int, limits: list[float], policy: str):
        self.graph = graph = build_graph(fused)
        self.parts, self.limits, self.policy = parts, limits, policy
        self.makespan = 0.0
        """The step's length, once `run` has placed every op."""
        table = costs.resolve(fused.num_devices, fused.num_stages, fused.num_slices)
        self.comm = table.comm
        self.duration, self.delta, self.w_time, self.w_memory = [], [], [], []
        for op in graph.ops:
            i = table.index(op)
            kind = _B if op.kind is _BW else op.kind  # the skeleton's BW stands for its B
            self.duration.append(table.time_of(kind, i))
            self.delta.append(table.delta_of(kind, i, op.ckpt))
            self.w_time.append(table.time_of(_W, i, parts))
            self.w_memory.append(-table.delta_of(_W, i, parts=parts))

    def run(self) -> list[list[Op]]:
        """Event-driven: a heap of (clock, device) over the devices that can act, and devices
        whose next op waits for an op not yet placed parked on that op until it is. Ties go to
        the lower device, as in a scan for the earliest clock. A device that is still the
        earliest after it acts acts again without a trip through the heap, and the ready time of
        its next op, once every input is in, is kept until that op runs."""
        graph = self.graph
        p = len(graph.offsets) - 1
        stops = graph.offsets[1:]
        end = [-1.0] * graph.num_ops
        head = list(graph.offsets[:-1])
        clock = [0.0] * p
        level = [0.0] * p
        queued: list[deque] = [deque() for _ in range(p)]  # (flat B, part)
        out: list[list[Op]] = [[] for _ in range(p)]
        parked: dict[int, list[int]] = {}  # op -> devices whose next op waits for it
        events = [(0.0, d) for d in range(p) if head[d] < stops[d]]
        known = [(-1, 0.0)] * p  # per device: (its next op, that op's ready time) once known
        d = -1
        while events or d >= 0:
            if d < 0:
                _, d = heappop(events)
            g = head[d] if head[d] < stops[d] else None
            if g is None:
                ready, missing = None, -1
            elif known[d][0] == g:
                ready, missing = known[d][1], -1
            else:
                ready, missing = self.ready_time(g, end)
                if ready is not None:
                    known[d] = (g, ready)
            if queued[d] and self.runs_a_part(d, g, ready, clock[d], level[d], self.w_time[queued[d][0][0]]):
                b, part = queued[d].popleft()
                op = graph.ops[b]
                out[d].append(Op(_W, op.stage, op.microbatch, op.slice, part=part, parts=self.parts))
                clock[d] += self.w_time[b]
                level[d] -= self.w_memory[b]
            elif g is not None and ready is not None and ready <= clock[d] + _EPS:
                op = graph.ops[g]
                end[g] = clock[d] = max(clock[d], ready) + self.duration[g]
                level[d] += self.delta[g]
                head[d] += 1
                if op.kind is _BW:  # a pair's head keeps its pairing (backward first)
                    out[d].append(Op(_B, op.stage, op.microbatch, op.slice, overlap_next=op.overlap_next))
                    queued[d].extend((g, part) for part in range(self.parts))
                else:
                    out[d].append(op)
                for waiter in parked.pop(g, ()):
                    heappush(events, (clock[waiter], waiter))
            elif ready is not None:
                clock[d] = ready
            else:
                parked.setdefault(missing, []).append(d)
                d = -1
                continue
            if not (head[d] < stops[d] or queued[d]):
                d = -1
            elif events and events[0] < (clock[d], d):  # another device is earlier now
                heappush(events, (clock[d], d))
                d = -1
        assert all(head[d] == stops[d] and not queued[d] for d in range(p)), "skeleton deadlock"
        self.makespan = max(clock, default=0.0)
        return out

    def ready_time(self, g: int, end: list[float]) -> tuple[float | None, int]:
        """When op g's inputs have all arrived, or (None, the first producer that has not run)."""
        graph = self.graph
        ready = 0.0
        for dep in graph.deps[g]:
            if end[dep] < 0:
                return None, dep
            arrival = end[dep] + (self.comm if graph.device_of[dep] != graph.device_of[g] else 0.0)
            ready = max(ready, arrival)
        return ready, -1

    def runs_a_part(self, d: int, g: int | None, ready: float | None, now: float, level: float, length: float) -> bool:
        """Whether device d runs its oldest queued W part (of `length`) before its next op g."""
        graph = self.graph
        if g is not None and g > graph.offsets[d] and graph.ops[g - 1].overlap_next:
            return False  # g is an overlapped pair's second op: nothing runs between the two
        if g is None or self.policy == "eager":
            return True  # the drain, or parts right after their B
        if level + max(self.delta[g], 0.0) > self.limits[d] + _EPS:
            return True  # memory: a pending W holds M_W
        if self.policy == "fit":
            return ready is not None and now + length <= ready + _EPS
        return ready is None or ready > now + _EPS  # the device would wait
