"""Why a prediction missed: the run's own op times, replayed through the simulator.

A predicted pipeline differs from a measured one for two kinds of reason: the ops took another
time than the costs said (the profile is off for this plan's ops), or the runtime spent time the
simulator does not know (waiting on a transfer, dispatching ops). Simulating the schedule again
with each op's measured duration separates them: the replay is what the simulator predicts from
perfect op times, so predicted → replayed is the op times' share of the error and replayed →
measured the runtime's. Per op kind, the measured time over the predicted says which figures
were off. Torch-free: it reads op records as (text, start, end) triples.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pipeloom.costs import Costs
from pipeloom.ir.graph import build_graph
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.walk import run
from pipeloom.sim.simulate import simulate

__all__ = ["Replay", "replay"]

DRIFT_BAND = 0.08
"""Op kinds whose measured-over-predicted ratios lie this close moved together: one cause."""

OpRecord = tuple[str, float, float]
"""An op's text and its start and end (ms from the step's start)."""


@dataclass(frozen=True)
class Replay:
    predicted: float
    """The pipeline simulated with the plan's costs (ms)."""
    replayed: float
    """The pipeline simulated with the run's median op durations (ms)."""
    measured: float
    """The run's pipeline: its slowest device's (ms)."""
    kinds: dict[str, float]
    """Per op kind, the run's total time over the predicted one, minus 1."""

    @property
    def drift(self) -> float | None:
        """The share every op kind moved by alike (within `DRIFT_BAND` of each other, the same
        way): the machine's own speed changed since the profile; None where the kinds differ."""
        ratios = list(self.kinds.values())
        if len(ratios) < 2 or max(ratios) - min(ratios) > DRIFT_BAND:
            return None
        if not (min(ratios) > 0 or max(ratios) < 0):
            return None
        return statistics.median(ratios)

    def explain(self, step: float, noise: float = 0.0) -> str:
        """The pipeline's error in two parts, as shares of a `step` ms step; `noise`: what the
        prediction already added for the ranks' step-to-step speed noise (ms), which the
        runtime's part is counted beyond."""
        ops, runtime = self.replayed - self.predicted, self.measured - self.replayed - noise
        off = ", ".join(f"{kind} {ratio:+.0%}" for kind, ratio in sorted(self.kinds.items()) if abs(ratio) >= 0.02)
        drift = self.drift
        alike = (
            f"; every op kind {'slower' if drift > 0 else 'faster'} alike: the machine ran {abs(drift):.0%} "
            f"{'slower' if drift > 0 else 'faster'} than while profiled"
            if drift is not None and abs(drift) >= 0.02
            else ""
        )
        return (
            f"op times {ops / step:+.1%} of the step (the run's own ops replayed: {self.replayed:.1f} ms against "
            f"{self.predicted:.1f}{'; ' + off + ' against the profile' if off else ''}{alike}), runtime "
            f"{runtime / step:+.1%} (measured {self.measured:.1f} ms: "
            f"{'idle beyond' if runtime >= 0 else 'less than'} what its ops"
            f"{f' and the predicted {noise:.1f} ms of speed noise' if noise else ''} explain)"
        )


def replay(schedule: Schedule, costs: Costs, steps_per_device: Sequence[Sequence[Sequence[OpRecord]]]) -> Replay:
    """`steps_per_device[d]`: device d's ops in each step measured (warm-up left out)."""
    graph = build_graph(schedule)
    planned = simulate(schedule, costs)
    medians: dict[tuple[int, str], float] = {}
    ends = []
    for device, steps in enumerate(steps_per_device):
        durations: dict[str, list[float]] = {}
        for ops in steps:
            for text, began, ended in ops:
                durations.setdefault(text, []).append(ended - began)
        medians.update({(device, text): statistics.median(values) for text, values in durations.items()})
        ends.append(statistics.median(max(ended for _, _, ended in ops) for ops in steps if ops))
    # an op the run did not time on its own (a W concatenated into the one before it) takes no time
    times = [medians.get((graph.device_of[g], op.text), 0.0) for g, op in enumerate(graph.ops)]
    _, finished = run(graph, times, costs.comm)
    kinds: dict[str, list[float]] = {}
    for g, op in enumerate(graph.ops):
        kind = op.kind.value
        measured = medians.get((graph.device_of[g], op.text), 0.0)
        totals = kinds.setdefault(kind, [0.0, 0.0])
        totals[0] += measured
        totals[1] += planned.end[g] - planned.start[g]
    ratios = {kind: measured / predicted - 1 for kind, (measured, predicted) in kinds.items() if predicted > 0}
    return Replay(planned.makespan, max(finished), max(ends), ratios)
