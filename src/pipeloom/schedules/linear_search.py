"""The best one-stage-per-device schedule under a memory budget: every construction, the shortest kept.

* the Zero Bubble authors' heuristic (`zb_heuristic`), as their runtime plans it (on the median
  stage's times) and on the exact per-stage times — so zb-auto is never behind the authors;
* our list scheduler (`list_scheduler`), its flags searched by `auto_search`; its runs are
  abandoned as soon as they cannot beat the authors' result, which keeps the search cheap.

Every construction keeps each device within its budget as it goes, so the shortest is returned
as it is.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.auto_search import LINEAR_FLAGS, auto_schedule, min_memory_limits, resolve_limits
from pipeloom.schedules.budget_ladder import monotone_best
from pipeloom.schedules.zb_heuristic import is_uniform, median_table, zb_heuristic
from pipeloom.stage_costs import StageCosts

__all__ = ["best_linear_schedule"]

_EPS = 1e-9


def best_linear_schedule(
    name: str, num_devices: int, num_microbatches: int, costs: Costs, budget: float | Sequence[float] | None
) -> Schedule:
    """The shortest schedule found for p devices, one stage each, within `budget` (activation
    memory per device; None: unlimited); never longer than one found for a smaller budget
    (`budget_ladder`). InfeasibleError below one micro-batch's activations."""
    p, m = num_devices, num_microbatches
    table = costs.resolve(p, p)
    limits = resolve_limits(name, budget, p, list(range(p)), table)
    floor = min_memory_limits(list(range(p)), table)
    ceiling = [2 * p * table.M_B[d] for d in range(p)]
    return monotone_best(
        ("linear", p, m, costs),
        name,
        costs,
        limits,
        floor,
        ceiling,
        3 * p * m,
        lambda b: _search(name, p, m, costs, table, b),
    )


def _search(name: str, p: int, m: int, costs: Costs, table: StageCosts, limits: list[float]) -> Schedule:
    placement = list(range(p))
    budget = None if all(math.isinf(limit) for limit in limits) else limits
    plans = [table] if is_uniform(table) else [table, median_table(table)]
    best = None
    for plan in plans:
        run = zb_heuristic(m, plan, table, limits, best.cost if best else float("inf"))
        if run is not None:
            best = run
    busiest = max(m * (table.F[s] + table.B[s] + table.W[s]) for s in range(p))
    if best is not None and best.cost <= busiest + _EPS:
        return best.schedule(name, m)  # no idle time on the busiest device: nothing can be shorter
    listed = auto_schedule(
        name, placement, m, costs, budget, flags=LINEAR_FLAGS, bound=best.cost if best else float("inf")
    )
    if listed is not None and (best is None or listed.cost < best.cost - _EPS):
        return listed.schedule
    assert best is not None  # the list scheduler runs unbounded when the heuristic found nothing
    return best.schedule(name, m)
