"""The best V-shape schedule under a memory budget: every construction, the shortest kept.

Three constructions, none best everywhere (bench/v_frontier.py shows where each wins):

* the building blocks (`v_blocks`): V-Min and V-Half repeated and squeezed, planned in the
  paper's memory model (a B frees nothing before its W) and in the real one, each under the
  block's own memory and under the budget;
* the paper's V greedy (`v_greedy`), under the budget;
* our list scheduler (`list_scheduler`, its flags searched by `auto_search`) under the budget.

The shortest within the budget (the simulator's span and peak) is then refined by filling its
idle gaps (`refine`), which never makes it longer or lets it exceed the budget.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.auto_search import auto_schedule
from pipeloom.schedules.list_scheduler import FLAGS, Heuristics
from pipeloom.schedules.refine import fill_gaps
from pipeloom.schedules.v_blocks import (
    VBlock,
    block_memory,
    block_peak,
    block_schedule,
    chunk_deltas,
    v_half_block,
    v_min_block,
)
from pipeloom.schedules.v_greedy import v_greedy
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.stage_costs import StageCosts

__all__ = ["v_placement", "best_v_schedule", "paper_block_budget", "PAPER_MODEL"]

PAPER_MODEL = 1.0
"""The paper's planning model: the share of M_B a B keeps until its W (all of it)."""
_EPS = 1e-9
_LARGE = 20_000
"""Beyond this many ops the list scheduler runs its starting flags only (one pass, not a search)
and the blocks are squeezed in the paper's model under their own memory only."""

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
    unlimited), refined. InfeasibleError if no construction fits."""
    table = costs.resolve(p, 2 * p)
    limits = list(budget) if budget is not None else [float("inf")] * p
    candidates: list[Timeline] = []

    def consider(schedule: Schedule) -> None:
        timeline = simulate(schedule, costs)
        if all(peak <= limit + _EPS for peak, limit in zip(timeline.peak_activation_memory, limits)):
            candidates.append(timeline)

    many = 6 * p * m > _LARGE
    for block in (v_min_block(p), v_half_block(p)):
        for planned in (PAPER_MODEL,) if many else (PAPER_MODEL, None):
            deltas = [chunk_deltas(table.M_B, table.M_W, d, p, planned) for d in range(p)]
            own = [block_peak(block, d, deltas[d]) for d in range(p)]
            if any(o > limit + _EPS for o, limit in zip(own, limits)):
                continue
            caps = {tuple([max(own)] * p)}
            if not many:
                caps.add(tuple(min(limit, 1e18) for limit in limits))
            for cap in caps:
                consider(block_schedule(block, m, deltas, cap, name))
    try:
        unlimited = [2 * p * (table.M_B[d] + table.M_B[2 * p - 1 - d]) for d in range(p)]  # 2p·M_B: no F waits
        consider(v_greedy(name, p, m, table, [min(limit, cap) for limit, cap in zip(limits, unlimited)]))
    except InfeasibleError:
        pass
    try:  # under some tight budgets its greedy stalls; the other constructions still stand
        listed = auto_schedule(
            name,
            v_placement(p),
            m,
            costs,
            budget,
            search="descent",
            start=_START,
            flags=() if many else _FLAGS,
        )
        consider(listed.schedule)
    except InfeasibleError:
        pass
    if not candidates:
        raise InfeasibleError(f"{name}: no V schedule found within the memory budget {limits}")
    best = min(candidates, key=lambda timeline: timeline.cost)
    refined = fill_gaps(best.schedule, costs, limits)
    return refined.schedule if refined.cost < best.cost - _EPS else best.schedule
