"""How much a rank's speed moves from step to step, as a distribution the tuner can draw from.

On a shared or virtual machine a rank runs some steps markedly slower than others (measured
here: a rank's ops summed over a step, 150 ms in most steps and 200 ms in one step of four) —
the core's clock, a neighbour on the host, the cache. In a pipeline that costs more than the
median op times say: each step waits for whichever rank was slow in it, so the median step is
longer than the step of median ops (measured 2–7 % on two-stage plans, nothing on one stage).
The profile keeps the distribution of a rank's step time over its median, per probe and rank,
as quantiles; `tune.speed_noise` draws a factor per device and step from them. Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

__all__ = ["QUANTILES", "step_busy", "speed_quantiles"]

QUANTILES = 21
"""Quantiles kept (every 5 %): the tail matters, a rank slow in one step of four."""


def step_busy(records: Iterable) -> list[float]:
    """A rank's time in ops (ms) in each step of `records` (warm-up already left out)."""
    return [1e3 * sum(end - start for _, start, end in record.ops) for record in records]


def speed_quantiles(series: Iterable[Sequence[float]]) -> list[float]:
    """`QUANTILES` quantiles of every step's time over its series' median (one series per probe
    and rank: the same work each step), from the fastest to the slowest; [] with too few steps."""
    factors = []
    for steps in series:
        if len(steps) >= 2 and (middle := statistics.median(steps)) > 0:
            factors += [value / middle for value in steps]
    if len(factors) < QUANTILES:
        return []
    return [
        float(q)
        for q in [min(factors), *statistics.quantiles(factors, n=QUANTILES - 1, method="inclusive"), max(factors)]
    ]
