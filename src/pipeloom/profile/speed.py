"""How much a rank's speed moves from step to step, and which steps ran at the machine's own.

On a shared or virtual machine a rank runs some steps markedly slower than others, and some ops
slower than others within a step. In a pipeline that costs more than the median op times say:
each step waits for whichever rank was slow in it, and skewed op times make even one device's
median step longer than the sum of its median ops. The profile keeps both as quantiles — a
rank's step time over its median, and an op's over its median with its step's factor taken out
— which `tune.speed_noise` draws from.

The speed also moves in spells of seconds, the ops still on the CPU (`docs/fidelity.md`), and
which share of a probe's steps falls in a slow one is luck. `steady_steps` keeps the steps that
ran at the machine's own speed — within `STEADY_BAND` of each rank's fast level — and every
median of the profile, and of the benches' measured steps, is taken over those. Torch-free.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence

from pipeloom.profile_format import Speed

__all__ = [
    "QUANTILES",
    "WARMUP_STEPS",
    "timed_steps",
    "warmup_steps",
    "STEADY_BAND",
    "step_busy",
    "steady_steps",
    "steady_rounds",
    "speed_quantiles",
    "op_ratios",
    "quantiles_of",
    "speed_of",
]

QUANTILES = 21
"""Quantiles kept (every 5 %): the tail matters, a rank slow in one step of four."""


STEADY_BAND = 0.15
"""How far beyond its rank's fast level a step may run and still be steady: the ops' own jitter
within a spell passes, the next slower spell does not (`docs/fidelity.md`)."""
_MIN_STEADY = 3
"""Fewer steady steps than this is no median: the steps are all kept instead."""


def steady_steps(busy: Sequence[Sequence[float]], band: float = STEADY_BAND) -> list[bool]:
    """Per step, whether every rank ran it at the machine's own speed. `busy[r][k]`: rank r's
    time in ops in step k (`step_busy`, over every round of the same work). A step is steady
    when each rank's time is within `band` over that rank's fast level (the lower quartile of
    its steps); when fewer than three are, all are kept (no spell to leave out can be told)."""
    steps = min((len(times) for times in busy), default=0)
    if steps < _MIN_STEADY:
        return [True] * steps
    limits = [(1 + band) * _lower_quartile(times) for times in busy]
    keep = [all(times[k] <= limit for times, limit in zip(busy, limits)) for k in range(steps)]
    return keep if sum(keep) >= _MIN_STEADY else [True] * steps


def steady_rounds(busy: Sequence[Sequence[Sequence[float]]]) -> list[list[bool]]:
    """`steady_steps` over rounds of the same work: `busy[round][rank][step]` → per round, which
    of its steps were steady, judged against every round's steps together."""
    ranks = len(busy[0]) if busy else 0
    flags = steady_steps([[time for round_ in busy for time in round_[rank]] for rank in range(ranks)])
    out, start = [], 0
    for round_ in busy:
        out.append(flags[start : start + len(round_[0])])
        start += len(round_[0])
    return out


def _lower_quartile(values: Sequence[float]) -> float:
    """A rank's fast level: inside the fast spell whenever a quarter of the steps ran in it, and
    no single step's luck."""
    return statistics.quantiles(values, n=4, method="inclusive")[0]


WARMUP_STEPS = 2
"""Steps a round runs before it is timed: the allocator and the caches warm over a run's first
two steps, and a later one runs as the rest do (`docs/fidelity.md`)."""


def warmup_steps(steps: int) -> int:
    """How many of a round's `steps` are warm-up: `WARMUP_STEPS`, but never all of them."""
    return max(0, min(WARMUP_STEPS, steps - 1))


def timed_steps(steps: list) -> list:
    """The steps a round times: all but its warm-up (`warmup_steps`)."""
    return steps[warmup_steps(len(steps)) :]


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


def speed_of(busy: Iterable[Sequence[float]], op_variation: Sequence[float]) -> Speed:
    """A layout's speed from its probes' steady steps (`busy`: one series per probe and rank,
    `step_busy`) and its ops' `op_ratios`: the step and op quantiles and, with any ops, the ops'
    mean factor (what a step of many ops carries over its median ops: `tune.speed_noise`)."""
    mean = statistics.fmean(op_variation) if op_variation else None
    return Speed(tuple(speed_quantiles(busy)), tuple(quantiles_of(op_variation)), mean)
