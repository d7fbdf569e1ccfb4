"""Searching the auto-scheduler's flags, and the memory limits it runs under.

`auto_schedule` is what the zero-bubble and V generators call: it resolves the costs for the
placement, checks the budget, and searches the `Heuristics` flags for the best greedy run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from pipeloom.budget import per_device
from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError
from pipeloom.schedules.list_scheduler import FLAGS, Heuristics, ListResult, ListScheduler
from pipeloom.stage_costs import StageCosts

LINEAR_FLAGS = ("eager_warmup", "lazy_forward", "critical_first", "tail_reserve")
"""The flags that matter with one stage per device (the others choose between a device's stages)."""

__all__ = ["LINEAR_FLAGS", "auto_schedule", "min_memory_limits", "resolve_limits"]

_EPS = 1e-9


def min_memory_limits(placement: Sequence[int], table: StageCosts) -> list[float]:
    """Per device: the least activation memory that holds one micro-batch through its stages."""
    need = [0.0] * (max(placement) + 1)
    for stage, device in enumerate(placement):
        need[device] += max(table.M_B[stage], table.M_W[stage])
    return need


def auto_schedule(
    name: str,
    placement: Sequence[int],
    num_microbatches: int,
    costs: Costs,
    mem_limit: float | Sequence[float] | None,
    search: str = "grid",
    flags: Sequence[str] = FLAGS,
    start: Heuristics | None = None,
    bound: float = math.inf,
) -> ListResult:
    """The best schedule the `Heuristics` flags lead to (smallest cost), by `search`:
    ``grid`` tries every combination of `flags` that can differ, ``descent`` flips one at a time.

    `mem_limit` is activation memory per device in the costs' memory unit (one number for every
    device, a per-device list, or None for unlimited). Runs after the first are abandoned once
    they cannot beat `bound` (another construction's cost) either.
    """
    num_devices = max(placement) + 1
    table = costs.resolve(num_devices, len(placement))
    limits = resolve_limits(name, mem_limit, num_devices, placement, table)

    def run(heuristics: Heuristics, bound: float = math.inf) -> ListResult | None:
        return ListScheduler(name, placement, num_microbatches, table, limits, heuristics).run(bound)

    # A flag that changed no decision of a run would replay that run when flipped, so it is not
    # flipped; a run is abandoned as soon as it cannot beat the best so far, and the grid does not
    # pursue combinations below an abandoned run.
    best = run(start or Heuristics())
    assert best is not None
    runs = 1
    if search == "grid":  # the paper's grid search, over the combinations that can differ
        frontier = [(best, 0)]
        while frontier:
            parent, first_flag = frontier.pop()
            for index in range(first_flag, len(flags)):
                flag = flags[index]
                if flag in parent.mattered:
                    runs += 1
                    child = run(
                        replace(parent.heuristics, **{flag: not getattr(parent.heuristics, flag)}),
                        min(best.cost, bound),
                    )
                    if child is not None:
                        best = child if child.cost < best.cost - _EPS else best
                        frontier.append((child, index + 1))
    elif search == "descent":  # one flag at a time from the best so far: at most one run per flag
        for flag in flags:
            if flag in best.mattered:
                runs += 1
                child = run(
                    replace(best.heuristics, **{flag: not getattr(best.heuristics, flag)}), min(best.cost, bound)
                )
                if child is not None and child.cost < best.cost - _EPS:
                    best = child
    else:
        raise ValueError(f"unknown search {search!r}")
    return replace(best, runs=runs)


def resolve_limits(
    name: str, mem_limit: float | Sequence[float] | None, num_devices: int, placement: Sequence[int], table: StageCosts
) -> list[float]:
    """One activation budget per device (inf when unlimited); InfeasibleError below the minimum."""
    if mem_limit is None:
        return [float("inf")] * num_devices
    limits = per_device(mem_limit, num_devices, name)
    for device, (limit, need) in enumerate(zip(limits, min_memory_limits(placement, table))):
        if limit + _EPS < need:
            raise InfeasibleError(
                f"{name}: memory limit {limit:g} on device {device} is below {need:g}, the activations of one "
                f"micro-batch through its stages there; raise the limit to at least {need:g}"
            )
    return limits
