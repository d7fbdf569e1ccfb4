"""V-shape schedules (Qi et al. 2024, "Pipeline Parallelism with Controllable Memory").

2p stages on p devices: device d runs stages d and 2p−1−d, so a micro-batch goes down the
devices and comes back up, and the first and last stage share device 0. Each device then holds
the same mix of early (long-lived) and late (short-lived) activations, which balances memory,
and the turn at device p−1 needs no communication.

The family differs only in the activation-memory budget the scheduler (Zero Bubble's heuristic,
`list_scheduler`) may use, relative to 1F1B's p·M_B (M_B: one device's share of the model):

* ``zb-v``   — p·M_B; zero bubble when T_F = T_B = T_W and m ≥ 2p;
* ``v-half`` — p·M_B / 2;
* ``v-min``  — p·M_B / 3;
* ``v-auto`` — any budget (one number or one per device), in the costs' memory unit.

A budget is never set below one micro-batch's activations through both stages of a device.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.auto_search import auto_schedule, min_memory_limits
from pipeloom.schedules.list_scheduler import FLAGS, Heuristics
from pipeloom.schedules.registry import register
from pipeloom.schedules.zero_bubble import DEFAULT_ZB_COSTS

__all__ = ["v_placement", "zb_v", "v_half", "v_min", "v_auto"]

# A V run costs twice a linear one (2p stages) and there are more flags, so the search flips one
# flag at a time, from the settings that suit two stages per device best: among ready forwards the
# deeper one (the turn of the V), and no W in gaps shorter than T_W. Three flags that almost never
# helped a V (in 63 setups: 3 wins, together 2.5 % of one step) are left out: a quarter less time.
_SEARCH = {
    "search": "descent",
    "start": Heuristics(deepest_forward=True, small_gap_rule=False),
    "flags": tuple(flag for flag in FLAGS if flag not in ("eager_warmup", "unpaced", "tail_reserve")),
}
_DOMAIN = "p >= 1, m >= 1; costs give T_F, T_B, T_W, comm, M_B, M_W (default all times 1)"


def v_placement(num_devices: int) -> list[int]:
    """Stage → device for the V: 0, 1, .., p−1, p−1, .., 1, 0."""
    return list(range(num_devices)) + list(range(num_devices - 1, -1, -1))


def _fraction_of_1f1b(name: str, num_devices: int, num_microbatches: int, costs: Costs | None, fraction: float):
    costs = costs or DEFAULT_ZB_COSTS
    placement = v_placement(num_devices)
    table = costs.resolve(num_devices, len(placement))
    floor = min_memory_limits(placement, table)
    budget = [
        max(floor[d], fraction * num_devices * (table.M_B[d] + table.M_B[2 * num_devices - 1 - d]))
        for d in range(num_devices)
    ]
    return auto_schedule(name, placement, num_microbatches, costs, budget, **_SEARCH).schedule


@register(
    "zb-v",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (ZB-V)",
    summary="V placement at 1F1B's memory; zero bubble when T_F = T_B = T_W",
    domain=_DOMAIN,
    options=("costs",),
)
def zb_v(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    return _fraction_of_1f1b("zb-v", num_devices, num_microbatches, costs, 1.0)


@register(
    "v-half",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-Half)",
    summary="V placement at half of 1F1B's activation memory",
    domain=_DOMAIN,
    options=("costs",),
)
def v_half(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    return _fraction_of_1f1b("v-half", num_devices, num_microbatches, costs, 1 / 2)


@register(
    "v-min",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory (V-Min)",
    summary="V placement at a third of 1F1B's activation memory",
    domain=_DOMAIN,
    options=("costs",),
)
def v_min(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    return _fraction_of_1f1b("v-min", num_devices, num_microbatches, costs, 1 / 3)


@register(
    "v-auto",
    family="v-shape",
    paper="Qi et al. 2024, Pipeline Parallelism with Controllable Memory",
    summary="V placement under any activation-memory budget",
    domain=_DOMAIN + "; mem_limit per device (None: unlimited)",
    options=("costs", "mem_limit"),
)
def v_auto(
    num_devices: int,
    num_microbatches: int,
    costs: Costs | None = None,
    mem_limit: float | Sequence[float] | None = None,
) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    return auto_schedule("v-auto", v_placement(num_devices), num_microbatches, costs, mem_limit, **_SEARCH).schedule
