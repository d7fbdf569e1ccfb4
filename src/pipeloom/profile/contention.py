"""Whether another process took the cores while a probe ran, from wall against CPU time.

On a CPU each rank computes its ops on one thread, so an op's wall time equals the CPU time its
thread ran — unless the scheduler gave the core to someone else meanwhile. The ratio of the two,
over a round's ops, reads contention directly, with no second run to compare with. Rounds above
`BUSY` are dropped and run again (a spike passes); when busy rounds keep coming the profile
refuses rather than fit a machine that is not the one the plans will run on (`allow`: keep them,
and say so). The ratios seen idle and busy are in `docs/fidelity.md`. Torch-free: it reads the
runtime's records (`StepRecord.op_cpu`).
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Sequence
from dataclasses import replace

from pipeloom.errors import RuntimeFault
from pipeloom.profile.speed import timed_steps
from pipeloom.profile_format import Noise

__all__ = ["BUSY", "Contention", "wall_over_cpu"]

BUSY = 1.10
"""Wall over CPU time above which a round counts as contended: well above an idle machine's
excess, well below what one busy neighbour adds (`docs/fidelity.md`)."""
REFUSE_AFTER = 3
"""Busy rounds after which, if they outnumber the clean ones, the machine is called busy."""


def wall_over_cpu(results: Sequence) -> float:
    """Wall over CPU seconds of every op the ranks timed after their warm-up (1.0 if none)."""
    wall = cpu = 0.0
    for result in results:
        for record in timed_steps(result.records):
            for (_, start, end), spent in zip(record.ops, record.op_cpu):
                if not math.isnan(spent):
                    wall, cpu = wall + end - start, cpu + spent
    return wall / cpu if cpu > 0 else 1.0


class Contention:
    """The rounds a profile ran, clean or busy; refuses once busy ones dominate."""

    def __init__(self, busy: float = BUSY, refuse_after: int = REFUSE_AFTER, allow: bool = False):
        self.busy, self.refuse_after, self.allow = busy, refuse_after, allow
        self.clean: list[float] = []
        self.contended: list[float] = []

    def clean_round(self, results: Sequence) -> bool:
        """Note a round; whether to keep it: it ran uncontended (else drop it and run it again),
        or busy rounds are allowed. Raises RuntimeFault when busy rounds reach `refuse_after`
        and outnumber the clean ones, unless allowed."""
        ratio = wall_over_cpu(results)
        if ratio <= self.busy:
            self.clean.append(ratio)
            return True
        self.contended.append(ratio)
        if self.allow:
            return True
        if len(self.contended) >= self.refuse_after and len(self.contended) > len(self.clean):
            raise RuntimeFault(self.refusal())
        return False

    def warning(self) -> str | None:
        """What a profile measured on a busy machine (allowed) should say about itself."""
        if not (self.allow and self.contended):
            return None
        return (
            f"measured on a busy machine: in {len(self.contended)} of {len(self.contended) + len(self.clean)} probe "
            f"runs the ops took {statistics.median(self.contended):.2f}× their CPU time on the wall clock, so its "
            "times read slow by about as much where the machine is idle"
        )

    def refusal(self) -> str:
        load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
        return (
            f"this machine is busy: in {len(self.contended)} of {len(self.contended) + len(self.clean)} probe runs "
            f"the ops took {statistics.median(self.contended):.2f}× their CPU time on the wall clock (idle: at most "
            f"{self.busy:.2f}×), so another process is using the cores (load average {load} on "
            f"{os.cpu_count()} cores) and a profile would describe that, not the machine: profile again when it is "
            "idle, or pass --allow-busy (PIPELOOM_ALLOW_BUSY=1 for `make demo`) to measure it as it is (the profile "
            "then says so)"
        )

    def described(self, noise: Noise) -> Noise:
        """`noise` with what this check saw: the clean rounds' wall over CPU time, the busy rounds,
        the limit, and whether busy rounds were kept."""
        wall_over_cpu = statistics.median(self.clean) if self.clean else 1.0
        return replace(
            noise,
            wall_over_cpu=wall_over_cpu,
            busy_rounds=len(self.contended),
            busy_limit=self.busy,
            busy_allowed=self.allow,
        )
