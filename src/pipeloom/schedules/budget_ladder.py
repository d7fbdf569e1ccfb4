"""Monotone in the budget: a schedule that fits a smaller budget is a candidate for a larger one.

The constructions behind zb-auto and the V family are greedy, and a greedy given more memory can
decide worse (bench/v_frontier.py found larger budgets giving longer V schedules). So a budgeted
search also builds within a fixed ladder of smaller budgets — the same rungs for every budget of
one input — and keeps the shortest schedule that fits, and every schedule built in this process
for the same input is remembered and offered again. A larger budget then never loses a schedule
a smaller one found on the ladder, nor one handed out before. The ladder is climbed only on
inputs small enough for it to be cheap (the property test's and most random checks'); large
inputs rely on the remembered schedules.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import Timeline, simulate

__all__ = ["monotone_best", "forget", "RUNGS"]

RUNGS = 4
"""Budgets on the ladder, geometric between the least feasible budget and the largest useful one."""
LADDER_OPS = 600
"""Climb the ladder only for schedules of at most this many ops."""
_EPS = 1e-9
_REMEMBERED: OrderedDict[Hashable, list[tuple[tuple[float, ...], float, Schedule]]] = OrderedDict()
_INPUTS = 64


def monotone_best(
    key: Hashable,
    name: str,
    costs: Costs,
    limits: Sequence[float],
    floor: Sequence[float],
    ceiling: Sequence[float],
    num_ops: int,
    build: Callable[[list[float]], Schedule | Timeline],
) -> Schedule:
    """The shortest of `build(limits)`, `build` on the ladder's rungs below `limits` (per device,
    between `floor` and `ceiling`), and the schedules remembered for `key` that fit `limits`.
    `build` may hand back its schedule's timeline, if it has one, to spare a simulation."""
    found = _REMEMBERED.setdefault(key, [])
    _REMEMBERED.move_to_end(key)
    while len(_REMEMBERED) > _INPUTS:
        _REMEMBERED.popitem(last=False)

    def remember(built: Schedule | Timeline) -> tuple[float, Schedule]:
        timeline = built if isinstance(built, Timeline) else simulate(built, costs)
        schedule, peaks, cost = timeline.schedule, tuple(timeline.peak_activation_memory), timeline.cost
        if any(all(a <= b + _EPS for a, b in zip(other, peaks)) and c <= cost + _EPS for other, c, _ in found):
            return cost, schedule  # one as short that fits every budget this one fits
        found[:] = [
            entry for entry in found if not (all(b <= a + _EPS for a, b in zip(entry[0], peaks)) and cost <= entry[1])
        ]
        found.append((peaks, cost, schedule))
        return cost, schedule

    budgets = [list(limits)]
    if num_ops <= LADDER_OPS:
        for rung in range(RUNGS):
            budget = [
                lo * (hi / lo) ** (rung / (RUNGS - 1)) if lo > 0 else hi * rung / (RUNGS - 1)
                for lo, hi in zip(floor, ceiling)
            ]
            if all(b < limit - _EPS for b, limit in zip(budget, limits)):
                budgets.append(budget)
    error: InfeasibleError | None = None
    fresh: tuple[float, Schedule] | None = None
    for budget in budgets:
        try:
            built = remember(build(budget))
            fresh = fresh or built
        except InfeasibleError as exc:
            error = error or exc
    fitting = [(cost, schedule) for peaks, cost, schedule in found if all(a <= b + _EPS for a, b in zip(peaks, limits))]
    if not fitting:
        assert error is not None
        raise error
    best_cost, best = min(fitting, key=lambda entry: entry[0])
    if fresh is not None and fresh[0] <= best_cost + _EPS:
        best = fresh[1]  # what a fresh process would answer, unless something found before is shorter
    return best if best.name == name else best.with_devices(best.devices, name=name)


def forget() -> None:
    """Drop every remembered schedule (`schedules.clear_caches`)."""
    _REMEMBERED.clear()
