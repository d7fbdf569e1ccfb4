"""Slice-level pipelines: MEPipe's SVPP (§4) and TeraPipe, micro-batches cut along the sequence.

Each micro-batch is cut into s causal slices; stage s of v·p runs on device s mod p. A slice's
forward needs the previous stage's output of that slice and, on its own stage, the keys and values
of the earlier slices; its backward needs the next stage's gradient and the gradients the later
slices sent back into its keys and values. One slice of one chunk holds A/(v·s·p) of activations
(A: one micro-batch through the whole model), so the more forwards a device runs before its first
backward (f), the more it holds and the fewer bubbles it has.

SVPP (§4.3) is built by list scheduling that simulates the step while building it: the device
with the earliest clock picks its next op. A backward that is ready runs, the deeper chunk first,
then the later slice, then the earlier micro-batch; else a ready forward runs if the device holds
fewer than f forwards, earliest micro-batch first; else the device waits. MEPipe orders backwards
by their descendants on the device ((slice l, chunk c) has (l+1)(c+1)−1, its "children"); that
ties a shallow chunk's late slice with a deep chunk's early one and, taking the shallow one, starts
its round trip through the other devices while the deep chunk's gradients still wait, which
leaves Table 3 short for n < p and for v ≥ 2 with s ≥ p. Deep chunk first meets Table 3 in both
columns for every (p ≤ 8, v ≤ 3, s ≤ 8, n ≤ 16) tried. Three switches choose among close variants, and the
best makespan wins: backward first, forward first, or alternating (one forward between two
backwards: MEPipe's "single bubbles" left for the next micro-batch's forwards); a micro-batch's
later chunk before its earlier one; and, only if the plain cap deadlocks, reserving room on a
device for the remaining forwards of every micro-batch that entered it before.

`svpp` defaults to the variant with the lowest bubble ratio (within 0.5 % of the step) and the
least f that reaches it. With T_B = T_F, as MEPipe's analysis assumes, that is Table 3's
f = v·max(p,s) + min(p,s) − 1, or all n·v·s forwards when fewer (Fig. 4: 5/8 A for p=4, s=2,
v=1; 9/16 A with v=2). With a memory limit it takes
the largest f whose simulated peak fits (§4.5). TeraPipe is GPipe over slices: every forward,
then every backward.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pipeloom.budget import per_device
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, InfeasibleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.registry import Tuning, register, require_int
from pipeloom.schedules.slice_scheduler import Beaten, Deadlock, Overflow, Policy, SliceScheduler
from pipeloom.sim.simulate import simulate

__all__ = ["svpp", "svpp_within", "terapipe", "table3_forwards", "DEFAULT_SVPP_COSTS"]

F, BW = OpKind.F, OpKind.BW
_EPS = 1e-9
_NEAR = 0.005
"""A step this much (relatively) longer than the shortest still counts as the lowest bubble:
the default variant does not buy the last fraction of a percent with whole micro-batches of memory."""

DEFAULT_SVPP_COSTS = Costs(F=1.0, B=1.0)
"""MEPipe's analysis assumes a slice's backward takes as long as its forward."""


def table3_forwards(num_devices: int, num_chunks: int, num_slices: int) -> int:
    """Forwards before the first backward in Table 3's variant: v·max(p,s) + min(p,s) − 1."""
    p, v, s = num_devices, num_chunks, num_slices
    return v * max(p, s) + min(p, s) - 1


@register(
    "svpp",
    family="slice-level",
    paper="MEPipe (Sun et al., EuroSys 2025), SVPP §4",
    summary="slices × virtual chunks, forward and backward interleaved per slice: ~A/min(s,p) activations",
    domain="p, m >= 1; v >= 1 chunks, s >= 1 slices; f >= v·s forwards before the first backward",
    options=("num_chunks", "num_slices", "forwards", "costs", "mem_limit"),
    tuning=Tuning(
        "svpp", chunks=(1, 2), slices=(2, 4), passes=("wparts",), budgeted=True, table3_forwards=True, fallbacks=()
    ),
)
def svpp(
    num_devices: int,
    num_microbatches: int,
    num_chunks: int = 1,
    num_slices: int = 2,
    forwards: int | None = None,
    costs: Costs | None = None,
    mem_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """SVPP with f = `forwards`, or the largest f within `mem_limit` (activation memory per
    device, a scalar or one per device), or Table 3's f.

    >>> print(svpp(2, 1, num_slices=2).to_text().splitlines()[1])
    0F0 0F0.1 0BW0.1 0BW0
    """
    p, m = num_devices, num_microbatches
    v = require_int("svpp", "num_chunks (v)", num_chunks, 1)
    s = require_int("svpp", "num_slices (s)", num_slices, 1)
    costs = costs if costs is not None else DEFAULT_SVPP_COSTS
    if forwards is not None and mem_limit is not None:
        raise ConfigError("svpp: give the number of forwards before the first backward or a memory limit, not both")
    if forwards is not None:
        require_int("svpp", "forwards (f)", forwards, v * s)
        return _shortest(p, m, v, s, forwards, costs).schedule
    lowest = _lowest_bubble(p, m, v, s, costs)
    if mem_limit is None:
        return lowest.schedule
    return _largest_fitting(p, m, v, s, costs, mem_limit, lowest).schedule


@register(
    "terapipe",
    family="slice-level",
    paper="TeraPipe (Li et al., ICML 2021)",
    summary="GPipe over slices: all slice forwards, then all backwards",
    domain="p, m >= 1; s >= 1 slices",
    options=("num_slices",),
    not_tuned="svpp with every forward before the first backward is TeraPipe; svpp's search includes it",
)
def terapipe(num_devices: int, num_microbatches: int, num_slices: int = 2) -> Schedule:
    """TeraPipe: device d runs every (micro-batch, slice) forward, then the backwards in reverse
    slice order.

    >>> print(terapipe(2, 1).to_text().splitlines()[1])
    0F0 0F0.1 0BW0.1 0BW0
    """
    s = require_int("terapipe", "num_slices (s)", num_slices, 1)
    m = num_microbatches
    devices = [
        [Op(F, d, mb, sl) for mb in range(m) for sl in range(s)]
        + [Op(BW, d, mb, sl) for mb in range(m) for sl in reversed(range(s))]
        for d in range(num_devices)
    ]
    return Schedule.build("terapipe", devices, num_stages=num_devices, num_microbatches=m, num_slices=s)


@dataclass(frozen=True, slots=True)
class _Built:
    forwards: int
    makespan: float
    held: int
    """The most forwards any device held at once."""
    schedule: Schedule


def _best_of_policies(
    p: int,
    m: int,
    v: int,
    s: int,
    forwards: int,
    costs: Costs,
    bound: float = math.inf,
    first: bool = False,
    room: Sequence[float] | None = None,
) -> _Built | None:
    """The shortest step over the policies (with `first`, the first to end by `bound`), or None
    if none ends by `bound`. A run is abandoned as soon as it cannot beat the best so far, and,
    with `room` (activation memory per device), as soon as a device holds more than its room."""
    best = None
    orders = (False, True) if v > 1 else (False,)
    for prefer, deep_first, taper in itertools.product(("alternate", "forward", "backward"), orders, (0, 1)):
        for reserve in (False, True):
            limit = min(bound, best[0]) if best else bound
            try:
                policy = Policy(prefer, deep_first, reserve, taper)
                run = SliceScheduler(p, m, v, s, forwards, costs, policy, room).run(limit)
            except Deadlock:
                continue  # the reserving run of the same policy cannot deadlock
            except (Beaten, Overflow):
                break
            if best is None or run[0] < best[0] - _EPS:
                best = run
            break
        if first and best is not None:
            break
    if best is None:
        return None
    makespan, held, order = best
    schedule = Schedule.build("svpp", order, num_stages=v * p, num_microbatches=m, num_slices=s)
    return _Built(forwards, makespan, held, schedule)


def svpp_within(
    num_devices: int,
    num_microbatches: int,
    num_chunks: int,
    num_slices: int,
    forwards: int,
    costs: Costs,
    mem_limit: Sequence[float],
) -> Schedule:
    """SVPP with f = `forwards`: the shortest policy whose activations fit `mem_limit` (per
    device), or InfeasibleError if none does. The tuner's build (f from Table 3): a policy run
    stops at the first device over its room, so an input that cannot fit costs a warm-up, not
    a dozen whole runs; and a policy that fits is kept where the shortest one would not."""
    p, m, v, s = num_devices, num_microbatches, num_chunks, num_slices
    built = _best_of_policies(p, m, v, s, forwards, costs, room=per_device(mem_limit, p, "svpp"))
    if built is None:
        raise InfeasibleError(
            f"svpp: with f = {forwards} forwards before the first backward, some device holds more activation "
            f"memory than the {min(mem_limit):g} left to it under every policy"
        )
    return built.schedule


def _shortest(p: int, m: int, v: int, s: int, forwards: int, costs: Costs) -> _Built:
    """The shortest step over the policies, with no bound to beat: a reserving run never
    deadlocks, so there always is one."""
    built = _best_of_policies(p, m, v, s, forwards, costs)
    if built is None:
        raise InfeasibleError(f"svpp: every policy deadlocked at f = {forwards} (internal error)")
    return built


def _lowest_bubble(p: int, m: int, v: int, s: int, costs: Costs) -> _Built:
    """The least f whose step is within `_NEAR` of the shortest any f gives. Under MEPipe's
    T_B = T_F this is Table 3's f; a longer backward needs more forwards in flight to cover the
    first backward's round trip."""
    unlimited = _shortest(p, m, v, s, m * v * s, costs)
    good_enough = unlimited.makespan * (1 + _NEAR)
    low, high = min(table3_forwards(p, v, s), unlimited.held), unlimited.held
    while low < high:
        middle = (low + high) // 2
        if _best_of_policies(p, m, v, s, max(middle, v * s), costs, bound=good_enough, first=True):
            high = middle
        else:
            low = middle + 1
    return _shortest(p, m, v, s, max(low, v * s), costs)


def _largest_fitting(p: int, m: int, v: int, s: int, costs: Costs, mem_limit, lowest: _Built) -> _Built:
    """The largest f (up to the lowest-bubble one) whose simulated peaks fit `mem_limit` (§4.5)."""
    limits = per_device(mem_limit, p, "svpp")

    def peaks(built: _Built) -> list[float]:
        return simulate(built.schedule, costs).peak_activation_memory

    def fits(built: _Built) -> bool:
        return all(peak <= limit + _EPS for peak, limit in zip(peaks(built), limits))

    if fits(lowest):
        return lowest
    low, high = v * s, lowest.forwards - 1
    best = _shortest(p, m, v, s, low, costs)
    if not fits(best):
        over = peaks(best)
        device = max(range(p), key=lambda d: over[d] - limits[d])
        raise InfeasibleError(
            f"svpp: device {device} needs {over[device]:g} of activation memory even with f = v·s = {low} "
            f"(one micro-batch's forwards before its first backward); raise its limit {limits[device]:g} to at least that"
        )
    while low < high:
        middle = (low + high + 1) // 2
        candidate = _shortest(p, m, v, s, middle, costs)
        if fits(candidate):
            low, best = middle, candidate
        else:
            high = middle - 1
    return best
