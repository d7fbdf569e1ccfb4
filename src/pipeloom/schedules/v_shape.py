"""V-shape schedules (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").

2p stages on p devices: device d runs stages d and 2p−1−d, so a micro-batch goes down the
devices and comes back up, and the first and last stage share device 0. Each device then holds
the same mix of early (long-lived) and late (short-lived) activations, which balances memory,
and the turn at device p−1 needs no communication.

The family differs only in the activation-memory budget (`v_search` finds the shortest schedule
within it), relative to 1F1B's p·M_B (M_B: one device's share of the model):

* ``zb-v``   — p·M_B; zero bubble when T_F = T_B = T_W and m ≥ 2p;
* ``v-half`` — the memory of the paper's V-Half block, about p·M_B / 2 (+ one micro-batch);
* ``v-min``  — the memory of the paper's V-Min block, about p·M_B / 3 (+ one micro-batch);
* ``v-auto`` — any budget (one number or one per device), in the costs' memory unit.

A budget is never set below one micro-batch's activations through both stages of a device.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.auto_search import min_memory_limits, resolve_limits
from pipeloom.schedules.registry import Tuning, register
from pipeloom.schedules.v_blocks import VBlock, v_half_block, v_min_block
from pipeloom.schedules.v_search import best_v_schedule, paper_block_budget, v_placement
from pipeloom.schedules.zero_bubble import DEFAULT_ZB_COSTS

__all__ = ["v_placement", "zb_v", "v_half", "v_min", "v_auto"]

_DOMAIN = "p >= 1, m >= 1; costs give T_F, T_B, T_W, comm, M_B, M_W (default all times 1)"


def _at_least_one_microbatch(p: int, costs: Costs, budget: list[float]) -> list[float]:
    floor = min_memory_limits(v_placement(p), costs.resolve(p, 2 * p))
    return [max(b, f) for b, f in zip(budget, floor)]


def _block_budget(name: str, p: int, m: int, costs: Costs | None, block: VBlock) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    budget = _at_least_one_microbatch(p, costs, paper_block_budget(block, costs.resolve(p, 2 * p)))
    return best_v_schedule(name, p, m, costs, budget)


@register(
    "zb-v",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (ZB-V)",
    summary="V placement at 1F1B's memory; zero bubble when T_F = T_B = T_W",
    domain=_DOMAIN,
    options=("costs",),
    not_tuned="the tuner's zb-v runs v-auto under the memory left after static memory (p·M_B or any other)",
    pareto="fixed",
)
def zb_v(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    p, table = num_devices, costs.resolve(num_devices, 2 * num_devices)
    budget = [p * (table.M_B[d] + table.M_B[2 * p - 1 - d]) for d in range(p)]
    return best_v_schedule("zb-v", p, num_microbatches, costs, _at_least_one_microbatch(p, costs, budget))


@register(
    "v-half",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-Half)",
    summary="V placement within the memory of the paper's V-Half block (about half of 1F1B's)",
    domain=_DOMAIN,
    options=("costs",),
    not_tuned="v-auto (the tuner's zb-v) within V-Half's budget",
    pareto="fixed",
)
def v_half(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    return _block_budget("v-half", num_devices, num_microbatches, costs, v_half_block(num_devices))


@register(
    "v-min",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-Min)",
    summary="V placement within the memory of the paper's V-Min block (about a third of 1F1B's)",
    domain=_DOMAIN,
    options=("costs",),
    not_tuned="v-auto (the tuner's zb-v) within V-Min's budget",
    pareto="fixed",
)
def v_min(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    return _block_budget("v-min", num_devices, num_microbatches, costs, v_min_block(num_devices))


@register(
    "v-auto",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory",
    summary="V placement under any activation-memory budget",
    domain=_DOMAIN + "; mem_limit per device (None: unlimited)",
    options=("costs", "mem_limit"),
    tuning=Tuning("zb-v", layout="v", budgeted=True, fallbacks=()),
    pareto="budgeted",
)
def v_auto(
    num_devices: int,
    num_microbatches: int,
    costs: Costs | None = None,
    mem_limit: float | Sequence[float] | None = None,
) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    p = num_devices
    placement = v_placement(p)
    budget = None
    if mem_limit is not None:
        budget = resolve_limits("v-auto", mem_limit, p, placement, costs.resolve(p, 2 * p))
    return best_v_schedule("v-auto", p, num_microbatches, costs, budget)
