"""The best V-shape schedule under a memory budget: every construction, the shortest kept.

Three constructions, none best everywhere (bench/v_frontier.py shows where each wins):

* the building blocks (`v_blocks`): V-Min and V-Half repeated and squeezed, planned in the
  paper's memory model (a B frees nothing before its W) and in the real one, each under the
  block's own memory and under the budget; and the authors' own V-Min and V-Half orders
  (`v_authors_blocks`), which on some sizes are shorter (beyond `_LARGE` ops, only theirs, of
  the block that holds the most that fits);
* the paper's V greedy (`v_greedy`), under the budget;
* our list scheduler (`list_scheduler`, its flags searched by `auto_search`) under the budget.

The shortest within the budget (the simulator's span and peak) is then refined by filling its
idle gaps (`refine`), which never makes it longer or lets it exceed the budget.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import lru_cache

from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.auto_search import auto_schedule, min_memory_limits
from pipeloom.schedules.budget_ladder import monotone_best
from pipeloom.schedules.list_scheduler import FLAGS, Heuristics
from pipeloom.schedules.refine import fill_gaps
from pipeloom.schedules.v_authors_blocks import authors_v_block
from pipeloom.schedules.v_blocks import (
    VBlock,
    block_memory,
    block_peak,
    block_schedule,
    chunk_deltas,
    v_half_block,
    v_min_block,
)
from pipeloom.schedules.v_greedy import median_plan, v_greedy, warm_up_memory
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.stage_costs import StageCosts

__all__ = ["v_placement", "best_v_schedule", "paper_block_budget", "forget", "PAPER_MODEL"]

PAPER_MODEL = 1.0
"""The paper's planning model: the share of M_B a B keeps until its W (all of it)."""
_EPS = 1e-9
_LARGE = 4_000
"""Beyond this many ops the list scheduler runs its starting flags only (one pass, not a search)
and only the block that holds the most is built, as the authors build it."""

# A V run costs twice a linear one (2p stages) and there are more flags, so the search flips one
# flag at a time, from the settings that suit two stages per device best: among ready forwards the
# deeper one (the turn of the V), and no W in gaps shorter than T_W. Three flags that almost never
# helped a V (in 63 setups: 3 wins, together 2.5 % of one step) are left out: a quarter less time.
_START = Heuristics(deepest_forward=True, small_gap_rule=False)
_FLAGS = tuple(flag for flag in FLAGS if flag not in ("eager_warmup", "unpaced", "tail_reserve"))


def v_placement(num_devices: int) -> list[int]:
    """Stage → device for the V: 0, 1, .., p−1, p−1, .., 1, 0."""
    return list(range(num_devices)) + list(range(num_devices - 1, -1, -1))


def paper_block_budget(block: VBlock, table: StageCosts) -> list[float]:
    """The block's steady-state memory in the paper's model, the largest over devices, for every
    device: what the paper's V-Min and V-Half schedules are planned to hold."""
    p = block.num_devices
    peaks = []
    for d in range(p):
        mb = (table.M_B[d], table.M_B[2 * p - 1 - d])
        peaks.append(block_memory(block, d, mb, mb))
    return [max(peaks)] * p


def best_v_schedule(name: str, p: int, m: int, costs: Costs, budget: Sequence[float] | None) -> Schedule:
    """The shortest V schedule found within `budget` (activation memory per device; None:
    unlimited), refined; never longer than one found for a smaller budget (`budget_ladder`).
    InfeasibleError if no construction fits."""
    table = costs.resolve(p, 2 * p)
    limits = list(budget) if budget is not None else [math.inf] * p
    floor = min_memory_limits(v_placement(p), table)
    ceiling = [2 * p * (table.M_B[d] + table.M_B[2 * p - 1 - d]) for d in range(p)]
    return monotone_best(
        ("v", p, m, costs), name, costs, limits, floor, ceiling, 6 * p * m, lambda b: _search(name, p, m, costs, b)
    )


def _search(name: str, p: int, m: int, costs: Costs, budget: Sequence[float]) -> Timeline:
    table = costs.resolve(p, 2 * p)
    limits = list(budget)
    unlimited = all(math.isinf(limit) for limit in limits)
    candidates: list[Timeline] = []

    def consider(schedule: Schedule) -> None:
        timeline = simulate(schedule, costs)
        if all(peak <= limit + _EPS for peak, limit in zip(timeline.peak_activation_memory, limits)):
            candidates.append(timeline)

    many = 6 * p * m > _LARGE
    blocks = []
    for block in (v_min_block(p), v_half_block(p)):
        for planned in (PAPER_MODEL,) if many else (PAPER_MODEL, None):
            deltas = [chunk_deltas(table.M_B, table.M_W, d, p, planned) for d in range(p)]
            own = [block_peak(block, d, deltas[d]) for d in range(p)]
            if all(o <= limit + _EPS for o, limit in zip(own, limits)):
                blocks.append((max(own), block, deltas))
    if many:  # only the block that holds the most (in the slot model the shortest), as the authors build it
        blocks = sorted(blocks, key=lambda entry: entry[0])[-1:]
        for _, block, _ in blocks:
            consider(authors_v_block(name, p, m, block.name.removeprefix("v-")))
    else:
        for own_peak, block, deltas in blocks:
            for cap in {tuple([own_peak] * p), tuple(min(limit, 1e18) for limit in limits)}:
                consider(block_schedule(block, m, deltas, cap, name))
        for which in ("min", "half"):
            consider(authors_v_block(name, p, m, which))
    for schedule in _greedy_schedules(p, m, table, limits, many):
        consider(schedule)
    try:  # under some tight budgets its greedy stalls; the other constructions still stand
        listed = auto_schedule(
            name,
            v_placement(p),
            m,
            costs,
            None if unlimited else limits,
            search="descent",
            start=_START,
            flags=() if many else _FLAGS,
            bound=min((timeline.cost for timeline in candidates), default=math.inf),
        )
        if listed is not None:
            consider(listed.schedule)
    except InfeasibleError:
        pass
    if not candidates:
        raise InfeasibleError(f"{name}: no V schedule found within the memory budget {limits}")
    best = min(candidates, key=lambda timeline: timeline.cost)
    refined = fill_gaps(best, costs, limits, sweeps=2 if many else 8)
    return refined if refined.cost < best.cost - _EPS else best


def _greedy_schedules(p: int, m: int, table: StageCosts, limits: list[float], many: bool = False) -> Iterator[Schedule]:
    """The V greedy's schedules that may fit `limits`: planned on the exact costs under the
    limits, and — as the authors' runtime runs ZB-V — on the median device's costs under their
    own budgets, p·M_B and 2p·M_B. Those budgets do not depend on `limits`, so whenever the
    authors' ZB-V fits a budget it is a candidate there; the exact costs are planned under them
    too, except on `many` ops (a greedy run each, for a rarely shorter schedule). A greedy
    whose warm-up alone exceeds `limits` is not run."""
    one_f_one_b = [p * (table.M_B[d] + table.M_B[2 * p - 1 - d]) for d in range(p)]
    runs = {(_key(table), tuple(min(limit, 2 * cap) for limit, cap in zip(limits, one_f_one_b)))}
    for plan in (median_plan(table, p),) if many else (median_plan(table, p), table):
        for factor in (1, 2):
            runs.add((_key(plan), tuple(factor * cap for cap in one_f_one_b)))
    for plan_key, caps in sorted(runs):
        schedule = _planned_greedy(p, m, plan_key, caps, tuple(limits))
        if schedule is not None:
            yield schedule


def _key(table: StageCosts) -> tuple:
    return (tuple(table.F), tuple(table.B), tuple(table.W), tuple(table.M_B), tuple(table.M_W), table.comm)


def _planned_greedy(
    p: int, m: int, plan_key: tuple, caps: tuple[float, ...], limits: tuple[float, ...]
) -> Schedule | None:
    """The V greedy planned on `plan_key`'s costs under `caps`; None if it cannot run, or if its
    warm-up alone holds more than `limits`."""
    warm = warm_up_memory(p, m, _plan_table(p, plan_key), list(caps))
    if warm is None or any(level > limit + _EPS for level, limit in zip(warm, limits)):
        return None
    return _greedy_run(p, m, plan_key, caps)


@lru_cache(maxsize=256)
def _greedy_run(p: int, m: int, plan_key: tuple, caps: tuple[float, ...]) -> Schedule | None:
    """Cached on what the run reads, the costs and caps, not the caller's limits: every budget
    of one input (the tuner's static measures, the V family's generators) asks for the same
    runs at the authors' budgets."""
    try:
        return v_greedy("v-greedy", p, m, _plan_table(p, plan_key), list(caps))
    except InfeasibleError:
        return None


def _plan_table(p: int, plan_key: tuple) -> StageCosts:
    F, B, W, M_B, M_W, comm = plan_key
    zero, forward = [0.0] * (2 * p), list(F)
    return StageCosts(
        num_slices=1,
        F=forward,
        B=list(B),
        W=list(W),
        R=zero,
        M_B=list(M_B),
        M_W=list(M_W),
        M_ckpt=list(M_B),
        M_static=[0.0] * (2 * p),
        comm=comm,
        a2a_F=zero,
        a2a_B=zero,
        BW=[b + w for b, w in zip(B, W)],
        F_BW=forward,  # the same list: no forward priced apart
    )


def forget() -> None:
    """Drop the cached greedy runs (`schedules.clear_caches`)."""
    _greedy_run.cache_clear()
