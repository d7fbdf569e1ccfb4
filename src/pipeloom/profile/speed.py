"""How much a rank's speed moves from step to step, as a distribution the tuner can draw from.

On a shared or virtual machine a rank runs some steps markedly slower than others (measured
here: a rank's ops summed over a step, 150 ms in most steps and 200 ms in one step of four) —
the core's clock, a neighbour on the host, the cache. In a pipeline that costs more than the
median op times say: each step waits for whichever rank was slow in it, so the median step is
longer than the step of median ops (measured 2–7 % on two-stage plans, nothing on one stage).
Ops vary within a step too (an op's time over its median with its step's speed taken out:
about ±4 % between quartiles here, and skewed: slow ops are slower than fast ones are fast),
and even one device's median step is longer than the sum of its median ops for it. The profile
keeps both distributions as quantiles — a rank's step time over its median per probe and rank
(`step_speed`), and an op's time over its median with its step's factor taken out (`op_speed`);
`tune.speed_noise` draws from them. Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

__all__ = ["QUANTILES", "step_busy", "speed_quantiles", "op_ratios", "quantiles_of"]

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
    return quantiles_of(factors)


def op_ratios(records: Sequence) -> list[float]:
    """Each op's time over its median in `records` (one rank's steps, the same ops each),
    divided by its step's factor (`speed_quantiles`' ratio): the op's own variation."""
    busy = step_busy(records)
    if len(busy) < 2 or (middle := statistics.median(busy)) <= 0:
        return []
    durations: dict[str, list[float]] = {}
    for record in records:
        for text, start, end in record.ops:
            durations.setdefault(text, []).append(end - start)
    medians = {text: statistics.median(values) for text, values in durations.items()}
    return [
        (end - start) / medians[text] / (step / middle)
        for record, step in zip(records, busy)
        for text, start, end in record.ops
        if medians[text] > 0 and step > 0
    ]


def quantiles_of(factors: Sequence[float]) -> list[float]:
    """`QUANTILES` evenly spaced quantiles, min and max included; [] with fewer values than that."""
    if len(factors) < QUANTILES:
        return []
    middle = statistics.quantiles(factors, n=QUANTILES - 1, method="inclusive")
    return [float(q) for q in [min(factors), *middle, max(factors)]]
