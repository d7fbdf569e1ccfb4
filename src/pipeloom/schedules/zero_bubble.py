"""Zero Bubble pipeline schedules (Qi et al., ICLR 2024): backward split into B and W.

* ``zb-h1`` / ``zb-h2`` — the handcrafted schedules of §2. Both follow 1F1B's shape; ZB-H1 delays
  device d's W by d micro-batches, so every device holds p micro-batches (1F1B's peak memory) and
  the bubble shrinks to (p−1)(T_F+T_B−T_W). ZB-H2 warms up with 2(p−d)−1 forwards and delays W
  by 2d, which turns the trapezoid into a parallelogram: bubble (p−1)(T_F+T_B−2T_W) at a peak of
  (2p−1)·M_B. For m < p both reduce to appendix H's (m+p−1)(T_F+T_B)+T_W step.
* ``zb-auto`` — the automatic scheduler of §3.1 (`list_scheduler`) under a memory limit;
  ``zb-1p`` and ``zb-2p`` fix the limit to p·M_B and 2p·M_B (§5.1).
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.linear_search import best_linear_schedule
from pipeloom.schedules.registry import Tuning, register

__all__ = ["zb_h1", "zb_h2", "zb_auto", "zb_1p", "zb_2p", "DEFAULT_ZB_COSTS"]

F, B, W = OpKind.F, OpKind.B, OpKind.W

DEFAULT_ZB_COSTS = Costs(F=1.0, B=1.0, W=1.0)
"""The handcrafted schedules' assumption T_F = T_B = T_W, used when no costs are given."""


def _handcrafted(name: str, p: int, m: int, warmup: Sequence[int], lag: Sequence[int]) -> Schedule:
    """`warmup[d]` forwards, then rounds of B, due W, F, where device d's W trails its B by `lag[d]`."""
    devices = []
    for d in range(p):
        ops = [Op(F, d, j) for j in range(min(warmup[d], m))]
        next_f, next_w = len(ops), 0
        for k in range(m):
            ops.append(Op(B, d, k))
            while next_w <= k - lag[d]:
                ops.append(Op(W, d, next_w))
                next_w += 1
            if next_f < m:
                ops.append(Op(F, d, next_f))
                next_f += 1
        ops += [Op(W, d, j) for j in range(next_w, m)]
        devices.append(ops)
    return Schedule.build(name, devices, num_stages=p, num_microbatches=m)


@register(
    "zb-h1",
    family="zero-bubble",
    paper="Qi et al. 2024, Zero Bubble Pipeline Parallelism, §2.1",
    summary="1F1B with split backward, W of device d delayed by d: 1F1B's memory, a third of its bubble",
    domain="p >= 1, m >= 1",
    tuning=Tuning("zb-h1"),
    pareto="fixed",
)
def zb_h1(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H1: 1F1B's order with device d's W lagging d micro-batches behind its B.

    >>> zb_h1(2, 2).to_text().splitlines()[1:]
    ['0F0 0F1 0B0 0W0 0B1 0W1', '1F0 1B0 1F1 1B1 1W0 1W1']
    """
    p = num_devices
    return _handcrafted("zb-h1", p, num_microbatches, [p - d for d in range(p)], list(range(p)))


@register(
    "zb-h2",
    family="zero-bubble",
    paper="Qi et al. 2024, Zero Bubble Pipeline Parallelism, §2.2",
    summary="more warm-up forwards and W reordered into a parallelogram: zero bubble at (2p-1)·M_B",
    domain="p >= 1, m >= 1 (zero bubble from m >= 2p-1 when T_F = T_B = T_W)",
    not_tuned="zb-auto at (2p-1)·M_B finds it or better",
    pareto="fixed",
)
def zb_h2(num_devices: int, num_microbatches: int) -> Schedule:
    """ZB-H2: device d warms up with 2(p−d)−1 forwards; its W lag 2d micro-batches behind its B."""
    p = num_devices
    return _handcrafted("zb-h2", p, num_microbatches, [2 * (p - d) - 1 for d in range(p)], [2 * d for d in range(p)])


_AUTO_DOMAIN = "p >= 1, m >= 1; costs give T_F, T_B, T_W, comm, M_B, M_W (default all times 1)"


@register(
    "zb-auto",
    family="zero-bubble",
    paper="Qi et al. 2024, Zero Bubble Pipeline Parallelism, §3.1",
    summary="automatic F/B/W scheduling from profiled costs under an activation-memory limit",
    domain=_AUTO_DOMAIN + "; mem_limit per device (None: unlimited)",
    options=("costs", "mem_limit"),
    tuning=Tuning("zb-auto", budgeted=True, fallbacks=()),
    pareto="budgeted",
)
def zb_auto(
    num_devices: int,
    num_microbatches: int,
    costs: Costs | None = None,
    mem_limit: float | Sequence[float] | None = None,
) -> Schedule:
    """The heuristic of §3.1 on p devices, one stage each; `mem_limit` in the costs' memory unit."""
    costs = costs or DEFAULT_ZB_COSTS
    return _linear("zb-auto", num_devices, num_microbatches, costs, mem_limit)


def _linear(name: str, p: int, m: int, costs: Costs, budget: float | Sequence[float] | None) -> Schedule:
    return best_linear_schedule(name, p, m, costs, budget)


def _stage_budget(num_devices: int, costs: Costs, factor: int) -> list[float]:
    """factor·p·M_B of each device's own stage: ZB-1p and ZB-2p's limits."""
    table = costs.resolve(num_devices, num_devices)
    return [factor * num_devices * table.M_B[d] for d in range(num_devices)]


@register(
    "zb-1p",
    family="zero-bubble",
    paper="Qi et al. 2024, Zero Bubble Pipeline Parallelism, §5.1",
    summary="zb-auto limited to p·M_B, the peak activation memory of 1F1B",
    domain=_AUTO_DOMAIN,
    options=("costs",),
    not_tuned="zb-auto within p·M_B, which the tuner searches with its own budget",
)
def zb_1p(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    budget = _stage_budget(num_devices, costs, 1)
    return _linear("zb-1p", num_devices, num_microbatches, costs, budget)


@register(
    "zb-2p",
    family="zero-bubble",
    paper="Qi et al. 2024, Zero Bubble Pipeline Parallelism, §5.1",
    summary="zb-auto limited to 2p·M_B: close to zero bubble",
    domain=_AUTO_DOMAIN,
    options=("costs",),
    not_tuned="zb-auto within 2p·M_B, which the tuner searches with its own budget",
)
def zb_2p(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    costs = costs or DEFAULT_ZB_COSTS
    budget = _stage_budget(num_devices, costs, 2)
    return _linear("zb-2p", num_devices, num_microbatches, costs, budget)
