"""The memory/bubble frontier: every applicable generator at every memory budget, simulated.

Fixed-shape schedules give one point each (T-Pipe also with T-Recomp); budget-driven ones
(``zb-auto``, ``v-auto``) are swept from the least memory they can run in to what they use
unconstrained. A point is on the frontier
when no other point has both less (or equal) peak activation memory and a lower bubble rate.
Memory is one device's share (Costs' scaling), so schedules with different stage counts compare.
Costs are given once, or as a function of a schedule's shape (a profile priced for each
schedule's own stages).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from pipeloom.costs import Costs, CostsFor, priced
from pipeloom.errors import ConfigError, PipeloomError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.split_backward import split_backward
from pipeloom.passes.trecomp import t_recomp
from pipeloom.schedules.auto_search import min_memory_limits
from pipeloom.schedules.registry import build_schedule, get_generator, list_generators, require_int
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.tune.zb_profiles import AUTHORS_V, table6_profile
from pipeloom.units import memory_unit, time_unit

__all__ = ["ParetoPoint", "explore_pareto", "frontier", "authors_points"]

_SPLIT = ("1f1b", "interleaved")  # also shown with the backward split and W filling bubbles
"""Pareto's own variants (passes, not generators): the split backward filling 1F1B's and the
interleaved schedule's bubbles; T-Recomp on TPipe. Which generators appear, and how, is the
registry's `pareto` description."""


@dataclass(frozen=True)
class ParetoPoint:
    label: str
    """Generator, with its budget or pass, e.g. ``zb-auto@12`` or ``1f1b+split-fill``."""
    peak_memory: float
    """Largest per-device peak activation memory."""
    bubble_rate: float
    cost: float
    on_frontier: bool = False
    timeline: Timeline | None = None
    reference: bool = False
    """One of the authors' named schedules (`authors_points`): shown beside ours, never on the frontier."""

    def to_dict(self) -> dict[str, Any]:
        """The point; `memory_unit` and `time_unit` say what peak_activation_memory and cost are in."""
        facts = {
            "label": self.label,
            "peak_activation_memory": self.peak_memory,
            "bubble_rate": self.bubble_rate,
            "cost": self.cost,
            "on_frontier": self.on_frontier,
        }
        if self.reference:
            facts |= {"reference": True, "cost": None}
        if self.timeline is not None:
            costs = self.timeline.costs
            facts |= {"memory_unit": memory_unit(costs), "time_unit": time_unit(costs)}
        return facts


def explore_pareto(
    num_devices: int,
    num_microbatches: int,
    costs: Costs | CostsFor,
    *,
    budgets: int = 12,
    progress: Callable[[int, int], None] | None = None,
    skipped: list[tuple[str, str]] | None = None,
) -> list[ParetoPoint]:
    """All points, sorted by memory then bubble, frontier marked.

    Generators outside their domain (Chimera with odd p, costs listed for another stage count)
    are left out; `skipped`, if given, receives (label, reason) for each.
    """
    require_int("pareto", "num_devices", num_devices, 1)
    require_int("pareto", "num_microbatches", num_microbatches, 1)
    if budgets < 1:
        raise ConfigError(f"pareto: the number of budgets per generator must be at least 1, got {budgets}")
    jobs = list(_jobs(num_devices, num_microbatches, costs, budgets))
    points = []
    for done, (label, make) in enumerate(jobs, 1):
        try:
            timeline = simulate(*make())
        except PipeloomError as error:
            timeline = None
            if skipped is not None:
                skipped.append((label, error.summary))
        if timeline is not None:
            points.append(
                ParetoPoint(
                    label, max(timeline.peak_activation_memory), timeline.bubble_rate, timeline.cost, False, timeline
                )
            )
        if progress:
            progress(done, len(jobs))
    authors = authors_points(num_devices, num_microbatches, costs) if isinstance(costs, Costs) else []
    return frontier(points + authors)


def frontier(points: list[ParetoPoint]) -> list[ParetoPoint]:
    """Sort by (memory, bubble) and mark the non-dominated points."""
    ordered = sorted(points, key=lambda q: (q.peak_memory, q.bubble_rate, q.label))
    best = float("inf")
    marked = []
    for point in ordered:
        on = not point.reference and point.bubble_rate < best - 1e-12
        if not point.reference:
            best = min(best, point.bubble_rate)
        marked.append(replace(point, on_frontier=on))
    return marked


def authors_points(num_devices: int, num_microbatches: int, costs: Costs) -> list[ParetoPoint]:
    """The V family authors' named schedules (ZB-V, V-Half, V-Min) when the costs are a Zero Bubble
    Table 6 profile (their bubble and peak from `zb_profiles.AUTHORS_V`); else none."""
    prof = table6_profile(num_devices, num_microbatches, costs)
    if prof is None:
        return []
    named = AUTHORS_V[(prof.model, num_microbatches)]
    return [
        ParetoPoint(f"authors: {name}", peak, bubble, float("nan"), reference=True)
        for name, (bubble, peak) in named.items()
    ]


Build = Callable[[Costs], Schedule]
"""A schedule from its costs (a cost-aware generator's shape does not depend on them)."""


def _jobs(p: int, m: int, costs: Costs | CostsFor, budgets: int) -> Iterator[tuple[str, Callable[[], Any]]]:
    def job(build: Build) -> Callable[[], tuple[Schedule, Costs]]:
        return lambda: priced(build, costs)

    def fixed(name: str) -> Build:
        aware = "costs" in get_generator(name).options
        return lambda c: build_schedule(name, p, m, **({"costs": c} if aware else {}))

    fixed_names = [info.name for info in list_generators() if info.pareto == "fixed"]
    budgeted = [info for info in list_generators() if info.pareto == "budgeted"]
    for name in fixed_names:
        yield name, job(fixed(name))
        if name in _SPLIT:
            yield f"{name}+split-fill", job(partial(_split_fill, name, p, m))
        if name == "tpipe":
            yield "tpipe+trecomp", job(lambda _: t_recomp(build_schedule("tpipe", p, m)))
    for info in budgeted:
        name = info.name
        assert info.tuning is not None, "a budgeted pareto entry is tuned: its layout places the stages"
        placement = info.tuning.device_of_stage(p)
        try:
            shaped = costs if isinstance(costs, Costs) else costs(len(placement), 1)
            table = shaped.resolve(p, len(placement))
        except ConfigError as error:  # costs listed for another stage count: left out, as the fixed ones are
            yield name, partial(_raise, error)
            continue
        low = max(min_memory_limits(placement, table))
        high = max(low, 2.0 * p * max(table.M_B) * len(placement) / p)  # ZB-2p's budget, one device's share
        for budget in _spread(low, high, budgets):
            yield f"{name}@{budget:.4g}", partial(_budgeted, name, p, m, budget, shaped)


def _split_fill(name: str, p: int, m: int, costs: Costs) -> Schedule:
    return split_backward(build_schedule(name, p, m), "fill", costs=costs)


def _budgeted(name: str, p: int, m: int, budget: float, costs: Costs) -> tuple[Schedule, Costs]:
    return build_schedule(name, p, m, costs=costs, mem_limit=budget), costs


def _spread(low: float, high: float, count: int) -> list[float]:
    if count == 1 or high <= low:
        return [high]
    return [low + (high - low) * i / (count - 1) for i in range(count)]


def _raise(error: Exception) -> Any:
    raise error
