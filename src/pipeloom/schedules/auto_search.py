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
) -> ListResult | None:
    """The best schedule the `Heuristics` flags lead to (smallest cost), by `search`:
    ``grid`` tries every combination of `flags` that can differ, ``descent`` flips one at a time.

    `mem_limit` is activation memory per device in the costs' memory unit (one number for every
    device, a per-device list, or None for unlimited). Every run is abandoned once it cannot beat
    `bound` (another construction's cost) or the best so far; None if every run was.
    """
    num_devices = max(placement) + 1
    table = costs.resolve(num_devices, len(placement))
    limits = resolve_limits(name, mem_limit, num_devices, placement, table)

    def run(heuristics: Heuristics, best: ListResult | None) -> tuple[ListResult | None, frozenset[str]]:
        """A run and the flags that changed its decisions (until it was abandoned, if it was)."""
        scheduler = ListScheduler(name, placement, num_microbatches, table, limits, heuristics)
        result = scheduler.run(min(best.cost, bound) if best else bound)
        return result, result.mattered if result else scheduler.beaten_mattered

    # A flag that changed no decision of a run would replay that run when flipped, so it is not
    # flipped; a run is abandoned as soon as it cannot beat the best so far, and the grid does not
    # pursue combinations below an abandoned run — below the first one only, as it is all there is.
    root = start or Heuristics()
    best, mattered = run(root, None)
    runs = 1
    if search == "grid":  # the paper's grid search, over the combinations that can differ
        frontier = [(root, mattered, 0)]
        while frontier:
            parent, parent_mattered, first_flag = frontier.pop()
            for index in range(first_flag, len(flags)):
                flag = flags[index]
                if flag in parent_mattered:
                    runs += 1
                    heuristics = replace(parent, **{flag: not getattr(parent, flag)})
                    child, child_mattered = run(heuristics, best)
                    if child is not None:
                        best = child if best is None or child.cost < best.cost - _EPS else best
                        frontier.append((heuristics, child_mattered, index + 1))
    elif search == "descent":  # one flag at a time from the best so far: at most one run per flag
        current = root
        for flag in flags:
            if flag in mattered:
                runs += 1
                heuristics = replace(current, **{flag: not getattr(current, flag)})
                child, child_mattered = run(heuristics, best)
                if child is not None and (best is None or child.cost < best.cost - _EPS):
                    best, current, mattered = child, heuristics, child_mattered
    else:
        raise ValueError(f"unknown search {search!r}")
    return replace(best, runs=runs) if best is not None else None


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
