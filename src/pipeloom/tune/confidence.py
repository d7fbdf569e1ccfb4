"""How far to trust a plan's predicted step, and when two plans are too close to tell apart.

A profile says how well it knows each op kind's time at each micro-batch size (`confidence`:
the relative standard error of the measured medians). A plan's step responds to each of those
figures as its schedule dictates — a 1 % dearer F moves a forward-bound plan more than a
W-filled one — so each figure is moved by its standard error and the schedule simulated again
(`sensitivities`). Figures measured apart are taken as independent errors, so a plan's band is
twice the root sum of squares of its sensitivities (about 95 %). Two plans share the figures
of their micro-batch size: an error that slows both cancels from their difference, which is
what decides whether their order is known (`tied`). Only the pipeline is moved; the all-reduce,
optimizer and step overhead come from fits of their own and are left as predicted.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace

from pipeloom.passes.offload import simulate_offload
from pipeloom.provenance import byte_size
from pipeloom.sim.simulate import simulate
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.evaluation import Evaluation

__all__ = [
    "figure_errors",
    "lever",
    "sensitivities",
    "band",
    "tied",
    "robustness",
    "measured_first",
    "note_extrapolations",
]

_KINDS = ("F", "B", "W", "BW", "F_BW", "R")
_Z = 2.0
"""Standard errors per side of a band: about 95 % for normal errors."""


def figure_errors(cost_model: CostModel, micro_batch: int, partition: Sequence[int] = ()) -> dict[str, float]:
    """Relative standard error per op kind at `micro_batch` (a size between two profiled ones
    takes the worse of the two) for a plan of `partition` (layers per stage), widened where the
    plan lies beyond what the profile measured (`lever`); {} for a cost model that measured
    nothing (analytic)."""
    profile = cost_model.profile
    if profile is None or not profile.plain.confidence:
        return {}
    confidence = profile.plain.confidence
    sizes = sorted(confidence)
    below = max([size for size in sizes if size <= micro_batch], default=sizes[0])
    above = min([size for size in sizes if size >= micro_batch], default=sizes[-1])
    layers = profile.plain.layers
    widened = lever(sizes, micro_batch) * max((lever(layers, n) for n in partition), default=1.0)
    return {
        kind: widened * max(confidence[below].get(kind, 0.0), confidence[above].get(kind, 0.0))
        for kind in _KINDS
        if kind in confidence[below] or kind in confidence[above]
    }


def lever(measured: Sequence[int], x: float) -> float:
    """How much less a line fitted through the `measured` points knows at `x` than at the nearest
    end of them: 1 within them; beyond, the ratio of the fit's standard error of prediction there,
    √(1/k + (x − x̄)² / Σ(xᵢ − x̄)²), to that at the end (a single point gives no slope: its error
    taken to grow with the distance, 1 + |x − end| / end)."""
    points = sorted(measured)
    if not points or points[0] <= x <= points[-1]:
        return 1.0
    end = points[0] if x < points[0] else points[-1]
    if len(points) == 1:
        return 1 + abs(x - end) / end
    mean = sum(points) / len(points)
    spread = sum((point - mean) ** 2 for point in points)

    def error(at: float) -> float:
        return math.sqrt(1 / len(points) + (at - mean) ** 2 / spread)

    return error(x) / error(end)


def sensitivities(evaluation: Evaluation, errors: dict[str, float]) -> dict[tuple[int, str], float]:
    """Per (micro-batch size, op kind): how much the step moves (ms) when that figure is one
    standard error dearer."""
    costs, timeline = evaluation.costs, evaluation.timeline
    if not any(error > 0 for error in errors.values()) or costs is None or timeline is None:
        return {}  # nothing measured (an analytic cost model): no schedule simulated again
    base = evaluation.offload.step_time if evaluation.offload is not None else timeline.makespan
    out = {}
    for kind, error in errors.items():
        value = getattr(costs, kind)
        if error <= 0 or value is None:
            continue
        moved = replace(costs, **{kind: _scaled(value, 1 + error)})
        out[evaluation.candidate.micro_batch, kind] = _pipeline(evaluation, moved) - base
    return out


def band(moves: dict[tuple[int, str], float]) -> float:
    """± ms around a plan's step (`sensitivities` of it)."""
    return _Z * math.sqrt(sum(move**2 for move in moves.values()))


def tied(first: Evaluation, second: Evaluation, moves: dict[int, dict]) -> bool:
    """Whether the two plans' steps differ by less than the band of their difference (`moves`:
    each plan's sensitivities, by id)."""
    one, two = moves[id(first)], moves[id(second)]
    difference = {key: one.get(key, 0.0) - two.get(key, 0.0) for key in one.keys() | two.keys()}
    return abs(second.step_time - first.step_time) <= band(difference)


def robustness(evaluation: Evaluation) -> tuple[float, int]:
    """What a near-tie is broken by, smaller first: peak memory (room for what the prediction
    missed), then pipeline ranks (fewer transfers and stages to wait on)."""
    return max(evaluation.peak_memory), evaluation.candidate.pp


def _pipeline(evaluation: Evaluation, costs) -> float:
    if evaluation.offload is not None:
        return simulate_offload(evaluation.offload.plan, costs).step_time
    assert evaluation.schedule is not None, "only simulated plans are ranked"
    return simulate(evaluation.schedule, costs).makespan


def _scaled(value, factor: float):
    if isinstance(value, tuple | list):
        return tuple(_scaled(entry, factor) for entry in value)
    return value * factor


def settle_near_ties(result, model_of: Callable[..., CostModel]) -> None:
    """Give each ranked plan its band (`result.bands`, ms) and, where the leader's lead is
    within the noise of the profile — of the two plans' difference, and at most the leader's own
    band — put the most robust of the tied plans first, noting why (`result.tie_note`). Nothing
    changes for a cost model that measured nothing. `model_of`: a plan's candidate → the cost
    model that priced it."""
    ranked = result.ranked
    moves = {
        id(e): sensitivities(e, figure_errors(model_of(e.candidate), e.candidate.micro_batch, e.partition))
        for e in ranked
    }
    result.bands = [band(moves[id(e)]) for e in ranked]
    if not any(result.bands):
        return
    fastest, fastest_band = ranked[0], result.bands[0]
    # within the noise of their difference, and never slower than the fastest plan's own band: a
    # plan whose figures are poorly known is not thereby as fast as a well-known one; and of the
    # leader's kind, measured or not (`measured_first` ranked the guesses after)
    close = [
        e
        for e in ranked
        if tied(fastest, e, moves)
        and e.step_time - fastest.step_time <= fastest_band
        and bool(e.extrapolated) == bool(fastest.extrapolated)
    ]
    if len(close) < 2:
        return
    chosen = min(close, key=robustness)
    places = ", ".join(str(ranked.index(e) + 1) for e in close)
    if chosen is fastest:
        result.tie_note = (
            f"plans {places} are within the profile's noise of each other; {fastest.candidate.label}, the fastest, "
            "also needs the least memory and pipeline ranks of them"
        )
        return
    (chosen_memory, chosen_pp), (fastest_memory, fastest_pp) = robustness(chosen), robustness(fastest)
    why = (
        f"lower peak memory ({byte_size(chosen_memory)} against {byte_size(fastest_memory)})"
        if chosen_memory < fastest_memory
        else f"fewer pipeline ranks ({chosen_pp} against {fastest_pp})"
    )
    index = ranked.index(chosen)
    result.bands.insert(0, result.bands.pop(index))
    ranked.insert(0, ranked.pop(index))
    result.tie_note = (
        f"plans {places} are within the profile's noise of each other ({fastest.candidate.label} is fastest at "
        f"{fastest.step_time:.1f} ± {fastest_band:.1f} ms, by {chosen.step_time - fastest.step_time:.1f} ms): "
        f"ranked {chosen.candidate.label} first for its {why}"
    )


def measured_first(result, model_of: Callable[..., CostModel], leader=None) -> None:
    """Mark the ranked plans priced beyond what the profile measured (`extrapolations`: a
    micro-batch size, slices or layers a stage it never ran), and the fastest of those the search
    set aside (`leader`), and keep them after the measured ones (the search ranked each group
    apart, `tune.search.tune`). Nothing changes for a cost model that measured nothing.
    `model_of`: a plan's candidate → the cost model that priced it."""
    ranked = result.ranked
    for evaluation in [*ranked, *([leader] if leader is not None else [])]:
        candidate = evaluation.candidate
        reasons = model_of(candidate).extrapolations(candidate.micro_batch, candidate.slices, evaluation.partition)
        evaluation.extrapolated = tuple(reasons)
    order = sorted(range(len(ranked)), key=lambda i: bool(ranked[i].extrapolated))  # stable: by step within each
    bands = result.bands or [0.0] * len(ranked)
    result.ranked, result.bands = [ranked[i] for i in order], [bands[i] for i in order]


def note_extrapolations(result, leader=None) -> None:
    """Say so (`result.extrapolation_note`) when the fastest plan priced beyond the profile
    (`leader`, marked by `measured_first`) would beat the first measured plan, or when every
    ranked plan is such a guess; else, where the ranking holds such plans, what their mark
    means."""
    marked = next((e for e in result.ranked if e.extrapolated), None)
    if leader is None or not leader.extrapolated:
        leader = marked
    if leader is None:
        return
    why = "; ".join(leader.extrapolated)
    first = result.ranked[0]
    if first.extrapolated:
        result.extrapolation_note = (
            f"every ranked plan is priced beyond what the profile measured ({why} for the fastest): profile "
            "those sizes before trusting the ranking"
        )
    elif leader.step_time < first.step_time:
        result.extrapolation_note = (
            f"plans priced beyond what the profile measured are ranked after the measured ones (marked ~): "
            f"{leader.candidate.label} would be {1 - leader.step_time / first.step_time:.1%} faster, but on {why}; "
            "profile those sizes to rank it on measured costs"
        )
    elif marked is not None:
        result.extrapolation_note = (
            f"plans marked ~ are priced beyond what the profile measured ({'; '.join(marked.extrapolated)} for "
            f"{marked.candidate.label}), so they are ranked after the measured ones"
        )
