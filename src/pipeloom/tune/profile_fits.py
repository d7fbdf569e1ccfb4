"""The fits a profile holds: a slope per layer and an intercept per stage position, and a value
measured at a few micro-batch sizes read at another. Torch-free, shared by the profiler that
fits them and the cost model that reads them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = ["fit_positions", "at_size"]


def fit_positions(points: Sequence[tuple[str, int, float]]) -> dict[str, float]:
    """Least squares of value = slope·n + intercept[position] over (position, n, value) points,
    with the middle and single intercepts derived from the first and last. Neither a layer nor a
    stage's fixed part costs less than nothing, so the fit is constrained to slope ≥ 0 and every
    intercept ≥ 0: noise on a busy machine (layers cheaper than its jitter, or one position's
    steeper than another's) must not price an op below zero."""
    by_position: dict[str, list[tuple[int, float]]] = {}
    for position, n, value in points:
        by_position.setdefault(position, []).append((n, value))
    slope = _nonnegative_slope(by_position)
    fit = {"per_layer": slope}
    for pos, xs in by_position.items():
        fit[pos] = max(0.0, statistics.fmean(v for _, v in xs) - slope * statistics.fmean(n for n, _ in xs))
    if {"first", "last"} <= fit.keys():
        # A middle stage has neither embedding nor head; the embedding is a lookup, so the cheaper
        # end is the closer estimate. A single stage has both.
        fit["middle"] = min(fit["first"], fit["last"])
        fit["single"] = max(fit["first"], fit["last"])
    return fit


def _nonnegative_slope(by_position: dict[str, list[tuple[int, float]]]) -> float:
    """The slope of the least squares under slope ≥ 0 and intercepts ≥ 0. Given the slope, each
    intercept is its position's mean residual clipped at zero, so the objective is a convex
    piecewise quadratic in the slope, with a knot where each position's intercept reaches zero:
    the minimum of each piece in closed form, the best of them taken."""
    means = {
        pos: (statistics.fmean(n for n, _ in xs), statistics.fmean(v for _, v in xs)) for pos, xs in by_position.items()
    }

    def residual(slope: float) -> float:
        total = 0.0
        for pos, xs in by_position.items():
            intercept = max(0.0, means[pos][1] - slope * means[pos][0])
            total += sum((v - slope * n - intercept) ** 2 for n, v in xs)
        return total

    knots = sorted({0.0, *(v / n for n, v in means.values() if n > 0 and v > 0)})
    candidates = []
    for low, high in zip(knots, [*knots[1:], math.inf]):
        clipped = {pos for pos, (n, v) in means.items() if n > 0 and v <= low * n}  # intercept 0 on this piece
        cross = spread = 0.0
        for pos, xs in by_position.items():
            mean_n, mean_v = (0.0, 0.0) if pos in clipped else means[pos]
            cross += sum((n - mean_n) * (v - mean_v) for n, v in xs)
            spread += sum((n - mean_n) ** 2 for n, _ in xs)
        candidates.append(min(max(cross / spread if spread else low, low), high))
    return min(candidates, key=residual)


def at_size(values: dict[int, float], micro_batch: float, signed: bool = False) -> float:
    """A per-size measurement at `micro_batch`: linear between the profiled sizes (and beyond,
    along the last two), proportional to the size when only one was profiled; never below zero
    unless `signed` (a difference, not a time or a size)."""
    sizes = sorted(values)
    if len(sizes) == 1:
        value = values[sizes[0]] * micro_batch / sizes[0]
    else:
        low = max([s for s in sizes if s <= micro_batch], default=sizes[0])
        high = min([s for s in sizes if s > low], default=None)
        if high is None:
            low, high = sizes[-2], sizes[-1]
        a, b = values[low], values[high]
        value = a + (b - a) * (micro_batch - low) / (high - low)
    return value if signed else max(0.0, value)
