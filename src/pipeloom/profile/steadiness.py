"""Which steps of a probe a measurement is taken over, and when its rounds are enough: one policy
for every probe of every layout, and for the runs judged against them (`train --plan`, the benches).

A probe runs in rounds of a few training steps, by turns with the other probes (`probe_rounds`),
so that a busy spell of the machine falls on one round of many probes, which their other rounds
outvote, not on every round of one. Of each round:
- the first `WARMUP_STEPS` steps are left out (`timed_steps`): the allocator and the caches warm
  over them;
- on a CPU, a round whose ops took longer on the wall clock than on their thread's CPU clock by
  more than `BUSY` ran beside another process: it is run again, and a machine that stays busy is
  refused rather than measured (`Contention`);
- a step counts where every rank ran it at the machine's own speed, within `STEADY_BAND` of its
  fast level over every round of the same work (`steady_steps`): the speed also moves in spells
  of seconds, with the ops still on the cores, and which steps fall in a slow one is luck.
Rounds are added until the latest round's median agrees with the earlier rounds' — within
`TOLERANCE`, or within what noise alone explains — or they run out (`Series`); a quantity is the
median of its rounds' medians. The figures behind each threshold are in `docs/fidelity.md`.
Torch-free: it reads the runtime's records, and is tested on a fake clock.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pipeloom.errors import RuntimeFault
from pipeloom.profile_format import Noise

__all__ = [
    "BUSY",
    "Contention",
    "Measured",
    "Series",
    "STEADY_BAND",
    "TOLERANCE",
    "WARMUP_STEPS",
    "relative_spread",
    "steady_rounds",
    "steady_steps",
    "step_busy",
    "timed_steps",
    "wall_over_cpu",
]

WARMUP_STEPS = 2
"""Steps a round runs before it is timed; a later one runs as the rest do."""
BUSY = 1.10
"""Wall over CPU time above which a round counts as contended: well above an idle machine's
excess, well below what one busy neighbour adds."""
REFUSE_AFTER = 3
"""Busy rounds after which, if they outnumber the clean ones, the machine is called busy."""
STEADY_BAND = 0.15
"""How far beyond its rank's fast level a step may run and still be steady: the ops' own jitter
within a spell passes, the next slower spell does not."""
_MIN_STEADY = 3
"""Fewer steady steps than this is no median: the steps are all kept instead."""
TOLERANCE = 0.02
"""A median that moves by at most this share from one round to the next counts as settled."""
_SE_PER_IQR = 1.253 / 1.349
"""Standard error of a median per interquartile range, times √n (normal samples)."""


def timed_steps(steps: list) -> list:
    """The steps a round times: all but its warm-up, `WARMUP_STEPS` but never every step."""
    return steps[max(0, min(WARMUP_STEPS, len(steps) - 1)) :]


def step_busy(records: Iterable) -> list[float]:
    """A rank's time in ops (ms) in each step of `records` (warm-up already left out)."""
    return [1e3 * sum(end - start for _, start, end in record.ops) for record in records]


# -- contention: another process on the cores -----------------------------------------------------


def wall_over_cpu(results: Sequence) -> float:
    """Wall over CPU seconds of every op the ranks timed after their warm-up (1.0 if none). On a
    CPU each rank computes its ops on one thread, so the two agree unless the scheduler gave the
    core to someone else meanwhile."""
    wall = cpu = 0.0
    for result in results:
        for record in timed_steps(result.records):
            for (_, start, end), spent in zip(record.ops, record.op_cpu):
                if not math.isnan(spent):
                    wall, cpu = wall + end - start, cpu + spent
    return wall / cpu if cpu > 0 else 1.0


class Contention:
    """The rounds a profile ran, clean or busy; refuses once busy ones dominate (`allow`: keep
    them, and say so)."""

    def __init__(self, busy: float = BUSY, refuse_after: int = REFUSE_AFTER, allow: bool = False):
        self.busy, self.refuse_after, self.allow = busy, refuse_after, allow
        self.clean: list[float] = []
        self.contended: list[float] = []

    def clean_round(self, results: Sequence) -> bool:
        """Note a round; whether to keep it: it ran uncontended (else run it again), or busy
        rounds are allowed. RuntimeFault when busy rounds reach `refuse_after` and outnumber the
        clean ones, unless allowed."""
        ratio = wall_over_cpu(results)
        (self.clean if ratio <= self.busy else self.contended).append(ratio)
        if ratio <= self.busy or self.allow:
            return True
        if len(self.contended) >= self.refuse_after and len(self.contended) > len(self.clean):
            raise RuntimeFault(self.refusal())
        return False

    def _seen(self) -> str:
        rounds = len(self.contended) + len(self.clean)
        return (
            f"in {len(self.contended)} of {rounds} probe runs the ops took "
            f"{statistics.median(self.contended):.2f}× their CPU time on the wall clock"
        )

    def warning(self) -> str | None:
        """What a profile measured on a busy machine (allowed) should say about itself."""
        if not (self.allow and self.contended):
            return None
        return f"measured on a busy machine: {self._seen()}, so its times read slow by about as much where it is idle"

    def refusal(self) -> str:
        load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
        return (
            f"this machine is busy: {self._seen()} (idle: at most {self.busy:.2f}×), so another process is using "
            f"the cores (load average {load} on {os.cpu_count()} cores) and a profile would describe that, not the "
            "machine: profile again when it is idle, or pass --allow-busy (PIPELOOM_ALLOW_BUSY=1 for `make demo`) "
            "to measure it as it is (the profile then says so)"
        )

    def described(self, noise: Noise) -> Noise:
        """`noise` with what this check saw: the clean rounds' wall over CPU time, the busy rounds,
        the limit, and whether busy rounds were kept."""
        ratio = statistics.median(self.clean) if self.clean else 1.0
        return replace(
            noise, wall_over_cpu=ratio, busy_rounds=len(self.contended), busy_limit=self.busy, busy_allowed=self.allow
        )


# -- slow spells: the steps run at the machine's own speed ----------------------------------------


def steady_steps(busy: Sequence[Sequence[float]], band: float = STEADY_BAND) -> list[bool]:
    """Per step, whether every rank ran it at the machine's own speed. `busy[r][k]`: rank r's
    time in ops in step k (`step_busy`, over every round of the same work). A step is steady
    when each rank's time is within `band` over that rank's fast level (the lower quartile of
    its steps: inside the fast spell whenever a quarter of the steps ran in it, and no single
    step's luck); when fewer than three are, all are kept (no spell to leave out can be told)."""
    steps = min((len(times) for times in busy), default=0)
    if steps < _MIN_STEADY:
        return [True] * steps
    limits = [(1 + band) * _quartiles(times)[0] for times in busy]
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


# -- settling: enough rounds ----------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    median: float
    """The median of the rounds' medians."""
    spread: float
    """Interquartile range over the median, of the samples kept."""
    samples: int
    rounds: int
    stable: bool
    """False when the rounds ran out before the median settled."""
    between: float = 0.0
    """The standard error of the rounds' medians' mean, over the median: how far the machine's
    speed moved from round to round (0 for one round)."""

    @property
    def relative_error(self) -> float:
        """The median's standard error over the median: from the samples' spread
        (`_standard_error`), or from the rounds' medians where they disagree more. A round's
        samples are taken within one spell of the machine's speed, so their spread misses how
        that speed moves over minutes, which the rounds, minutes apart, show."""
        within = _SE_PER_IQR * self.spread / math.sqrt(self.samples) if self.samples >= 4 else 0.0
        return max(within, self.between)


class Series:
    """The rounds of one probe so far: `add` one round's samples; `settled` once the latest round
    agreed with the earlier ones (`_agrees`: within `tolerance`, `floor` for quantities too small
    to matter, or noise)."""

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
        out = {}
        for key, values in self.kept.items():
            medians = self.per_round[key]
            middle = statistics.median(medians)
            between = (
                statistics.stdev(medians) / math.sqrt(len(medians)) / abs(middle)
                if len(medians) > 1 and middle
                else 0.0
            )
            out[key] = Measured(middle, relative_spread(values), len(values), self.rounds, self.settled, between)
        return out


def relative_spread(samples: Sequence[float]) -> float:
    """Interquartile range over the median (0 for fewer than two samples or a zero median)."""
    if len(samples) < 2:
        return 0.0
    low, middle, high = _quartiles(samples)
    return (high - low) / abs(middle) if middle else 0.0


def _quartiles(values: Sequence[float]) -> list[float]:
    return statistics.quantiles(values, n=4, method="inclusive")


def _standard_error(values: Sequence[float]) -> float:
    """Of the median, from the interquartile range (σ ≈ IQR / 1.349, SE ≈ 1.253 σ / √n): noise
    itself moves a median by about this much from one round to the next."""
    if len(values) < 4:
        return 0.0
    low, _, high = _quartiles(values)
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
