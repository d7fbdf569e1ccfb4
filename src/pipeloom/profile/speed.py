"""How much a rank's speed moves from step to step, and an op's within a step.

On a shared or virtual machine a rank runs some steps markedly slower than others, and some ops
slower than others within a step. In a pipeline that costs more than the median op times say:
each step waits for whichever rank was slow in it, and skewed op times make even one device's
median step longer than the sum of its median ops. The profile keeps both as quantiles — a
rank's step time over its median, and an op's over its median with its step's factor taken out
— which `tune.speed_noise` draws from.

Both are taken over the steps that ran at the machine's own speed (`steadiness`). Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from pipeloom.profile.steadiness import step_busy
from pipeloom.profile_format import Speed

__all__ = ["QUANTILES", "speed_quantiles", "op_ratios", "quantiles_of", "speed_of"]

QUANTILES = 21
"""Quantiles kept (every 5 %): the tail matters, a rank slow in one step of four."""
MIN_FACTORS = 4
"""Fewer say nothing of a spread; fewer than `QUANTILES` do (the README's quick start has 16)."""


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
    """`QUANTILES` evenly spaced quantiles, min and max included, linear between the values where
    they are fewer; [] with fewer than `MIN_FACTORS`."""
    if len(factors) < MIN_FACTORS:
        return []
    middle = statistics.quantiles(factors, n=QUANTILES - 1, method="inclusive")
    return [float(q) for q in [min(factors), *middle, max(factors)]]


def speed_of(busy: Iterable[Sequence[float]], op_variation: Sequence[float]) -> Speed:
    """A layout's speed from its probes' steady steps (`busy`: one series per probe and rank,
    `step_busy`) and its ops' `op_ratios`: the step and op quantiles and, with any ops, the ops'
    mean factor (what a step of many ops carries over its median ops: `tune.speed_noise`)."""
    mean = statistics.fmean(op_variation) if op_variation else None
    return Speed(tuple(speed_quantiles(busy)), tuple(quantiles_of(op_variation)), mean)
