"""When a measurement can be trusted: warm-up left out, repeated until its median holds still.

A machine that is busy (another job, a turbo clock settling, a cold cache) makes one run of a
probe read slower or faster than the next. Each probe is therefore a series of rounds — a round
is one run of a few training steps, its first step(s) left out as warm-up — and a quantity (an
op's time, the optimizer's) is taken as the median of its rounds' medians. Rounds are added until
the latest round's median agrees with the earlier rounds' — within `tolerance` of it, or within
what noise alone would explain (twice the standard error of the difference) — or the rounds run
out. So there are always two rounds: one that ran wholly in a busy spell would look settled on
its own. The spread (the interquartile range over the median) says how noisy the samples were,
so a profile can report how far to trust it. Torch-free, so it is tested on a fake clock.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeloom.profile_format import Fit

__all__ = ["Measured", "Series", "relative_spread", "falling_per_sample", "TOLERANCE"]

_SE_PER_IQR = 1.253 / 1.349
"""Standard error of a median per interquartile range, times √n (normal samples)."""

TOLERANCE = 0.02
"""A median that moves by at most this share from one round to the next counts as settled."""


@dataclass(frozen=True)
class Measured:
    median: float
    """The median of the rounds' medians."""
    spread: float
    """Interquartile range over the median, of the samples kept."""
    samples: int
    rounds: int
    stable: bool
    """False when `max_rounds` ran out before the median settled."""

    @property
    def relative_error(self) -> float:
        """The median's standard error over the median, from the spread (`_standard_error`)."""
        return _SE_PER_IQR * self.spread / math.sqrt(self.samples) if self.samples >= 4 else 0.0


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two samples or a zero median)."""
    if len(samples) < 2:
        return 0.0
    low, _, high = statistics.quantiles(samples, n=4, method="inclusive")
    middle = statistics.median(samples)
    return (high - low) / abs(middle) if middle else 0.0


class Series:
    """The rounds of one probe so far: `add` one round's samples; `settled` once the latest round
    agreed with the earlier ones (`_agrees`: within `tolerance`, `floor` for quantities too small
    to matter, or noise). Several series can take turns — round 1
    of every probe, then round 2 of each that has not settled — so a busy spell falls on one
    round of many probes, which their other rounds outvote, not on every round of one probe."""

    def __init__(self, tolerance: float = TOLERANCE, floor: float = 0.0):
        self.tolerance, self.floor = tolerance, floor
        self.kept: dict[str, list[float]] = {}
        self.per_round: dict[str, list[float]] = {}
        self.rounds = 0
        self.settled = False

    def add(self, samples: Mapping[str, Sequence[float]]) -> bool:
        """One round's samples (warm-up already left out); whether the series has now settled."""
        fresh = {key: [float(v) for v in values] for key, values in samples.items() if len(values)}
        if self.kept:
            self.settled = all(
                _agrees(values, self.kept.get(key, []), self.tolerance, self.floor) for key, values in fresh.items()
            )
        for key, values in fresh.items():
            self.kept.setdefault(key, []).extend(values)
            self.per_round.setdefault(key, []).append(statistics.median(values))
        self.rounds += 1
        return self.settled

    def measured(self) -> dict[str, Measured]:
        """The median of the rounds' medians: a busy spell is one round, outvoted by the others."""
        return {
            key: Measured(
                statistics.median(self.per_round[key]), relative_spread(values), len(values), self.rounds, self.settled
            )
            for key, values in self.kept.items()
        }


def _standard_error(values: Sequence[float]) -> float:
    """Of the median, from the interquartile range (σ ≈ IQR / 1.349, SE ≈ 1.253 σ / √n): noise
    itself moves a median by about this much from one round to the next."""
    if len(values) < 4:
        return 0.0
    low, _, high = statistics.quantiles(values, n=4, method="inclusive")
    return _SE_PER_IQR * (high - low) / math.sqrt(len(values))


def _agrees(fresh: Sequence[float], earlier: Sequence[float], tolerance: float, floor: float) -> bool:
    """Whether a round's median is the earlier rounds' within `tolerance`, `floor`, or twice the
    standard error of their difference (each side's noise from its own spread, so a drift from
    round to round shows however noisy the rounds are put together)."""
    if not fresh or not earlier:
        return False
    new, old = statistics.median(fresh), statistics.median(earlier)
    noise = 2 * (_standard_error(fresh) ** 2 + _standard_error(earlier) ** 2) ** 0.5
    return abs(new - old) <= max(tolerance * max(abs(new), abs(old)), floor, noise)


def falling_per_sample(fits: Mapping[int, Mapping[str, Fit]], noise: float, describe: bool = False) -> list:
    """Micro-batch sizes whose per-sample layer time (F + B + W per layer, over the micro-batch
    size) is lower than a smaller size's by more than `noise` — on a CPU a busy spell during
    the small size's probes reads that way; with `describe`, one warning per such pair."""
    sizes = sorted(fits)
    suspects, warnings = set(), []
    for small, large in zip(sizes, sizes[1:]):
        per_small = _layer_ms(fits[small]) / small
        per_large = _layer_ms(fits[large]) / large
        if per_large < per_small * (1 - noise):
            suspects |= {small, large}
            warnings.append(
                f"per-sample layer time falls from {per_small:.3g} ms at micro-batch {small} to {per_large:.3g} ms "
                f"at {large}, beyond the {noise:.0%} the probes varied by, with busy rounds kept: the machine's "
                "other work may have slowed the smaller size (run `profile` again on an idle machine), or "
                "larger micro-batches are truly more efficient here"
            )
    return warnings if describe else sorted(suspects)


def _layer_ms(fit: Mapping[str, Fit]) -> float:
    return sum(fit[kind].per_layer for kind in ("F", "B", "W") if kind in fit)
