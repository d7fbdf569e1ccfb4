"""Why a prediction missed: the run's own op times, replayed through the simulator.

A predicted pipeline differs from a measured one for two kinds of reason: the ops took another
time than the costs said (the profile is off for this plan's ops), or the runtime spent time the
simulator does not know (waiting on a transfer, dispatching ops). Simulating the schedule again
with each op's measured duration separates them: the replay of the median op times is what the
simulator predicts from perfect op times, so predicted → replayed is the op times' share of the
error. Each step replayed with its own op times, the median of those is what the ops' variation
from step to step adds (a pipeline waits for its slowest path in each step); what the run took
beyond that is the runtime's. Per op kind, the measured time over the predicted says which figures
were off, and where every pass moved alike the machine's own speed changed since the profile (a
W the runtime ran inside its B, as it does where nothing waits for the B, counts with it: the
backward's passes are judged together). Torch-free: it reads op records as (text, start, end)
triples.
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

__all__ = ["Replay", "replay", "replay_records"]

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
    """The run's pipeline: the median over steps of its slowest device's (ms)."""
    stepwise: float
    """The median over steps of each step's own op times replayed (ms): beyond `replayed`, what
    the ops' variation from step to step costs a pipeline that waits for its slowest path."""
    kinds: dict[str, float]
    """Per op kind, the run's total time over the predicted one, minus 1."""
    passes: dict[str, float]
    """The same with the backward's kinds (B, W, BW) together: what a W run inside its B moves."""

    @property
    def drift(self) -> float | None:
        """The share every pass moved by alike (within `DRIFT_BAND` of each other, the same way):
        the machine's own speed changed since the profile; None where the passes differ."""
        ratios = list(self.passes.values())
        if len(ratios) < 2 or max(ratios) - min(ratios) > DRIFT_BAND:
            return None
        if not (min(ratios) > 0 or max(ratios) < 0):
            return None
        return statistics.median(ratios)

    def explain(self, step: float, noise: float = 0.0) -> str:
        """The pipeline's error in three parts, as shares of a `step` ms step: the op times, their
        variation (beyond the `noise` ms the prediction added for it) and the runtime."""
        ops, varied = self.replayed - self.predicted, self.stepwise - self.replayed - noise
        runtime = self.measured - self.stepwise
        folded = any(ratio <= -0.9 for ratio in self.kinds.values())  # a kind mostly run inside another
        shown = self.passes if folded else self.kinds
        off = ", ".join(f"{kind} {ratio:+.0%}" for kind, ratio in sorted(shown.items()) if abs(ratio) >= 0.02)
        drift = self.drift
        alike = (
            f"; every op kind {'slower' if drift > 0 else 'faster'} alike: the machine ran {abs(drift):.0%} "
            f"{'slower' if drift > 0 else 'faster'} than while profiled"
            if drift is not None and abs(drift) >= 0.02
            else ""
        )
        return (
            f"op times {ops / step:+.1%} of the step (the run's own ops replayed: {self.replayed:.1f} ms against "
            f"{self.predicted:.1f}{'; ' + off + ' against the profile' if off else ''}{alike}), their variation "
            f"{varied / step:+.1%} (each step's own ops replayed: {self.stepwise:.1f} ms, against the "
            f"{noise:.1f} ms of speed noise predicted), runtime {runtime / step:+.1%} (measured {self.measured:.1f} ms: "
            f"{'idle beyond' if runtime >= 0 else 'less than'} what each step's ops explain)"
        )


def replay(schedule: Schedule, costs: Costs, steps_per_device: Sequence[Sequence[Sequence[OpRecord]]]) -> Replay:
    """`steps_per_device[d]`: device d's ops in each step measured (warm-up left out), the
    devices' steps in the same order and, for `measured`, on one clock."""
    graph = build_graph(schedule)
    planned = simulate(schedule, costs)
    # The runtime's own time around each op, which the plan prices inside each op's duration
    # (`Costs.op_overhead`; a W in k parts 1/k of it a part, as of its W) and a run times between
    # its ops: put back on the run's op times to replay them, taken off the plan's to compare the
    # op times alone.
    overheads = [costs.op_overhead / op.parts for op in graph.ops]
    steps = min(len(device_steps) for device_steps in steps_per_device)
    per_step: list[dict[tuple[int, str], float]] = [{} for _ in range(steps)]
    for device, device_steps in enumerate(steps_per_device):
        for k, ops in enumerate(device_steps[:steps]):
            for text, began, ended in ops:
                per_step[k][device, text] = ended - began
    medians = {key: statistics.median(step.get(key, 0.0) for step in per_step) for key in per_step[0]}
    measured = statistics.median(
        max(ended for device_steps in steps_per_device for _, _, ended in device_steps[k]) for k in range(steps)
    )

    def makespan(durations: dict[tuple[int, str], float]) -> float:
        # an op the run did not time on its own (a W concatenated into the one before it) takes no time
        times = [durations.get((graph.device_of[g], op.text), 0.0) for g, op in enumerate(graph.ops)]
        return max(run(graph, [t + extra if t else t for t, extra in zip(times, overheads)], costs.comm)[1])

    kinds: dict[str, list[float]] = {}
    passes: dict[str, list[float]] = {}
    for g, op in enumerate(graph.ops):
        kind = op.kind.value
        for totals in (kinds.setdefault(kind, [0.0, 0.0]), passes.setdefault(_PASSES.get(kind, kind), [0.0, 0.0])):
            totals[0] += medians.get((graph.device_of[g], op.text), 0.0)
            planned_op = planned.end[g] - planned.start[g]
            totals[1] += planned_op - overheads[g] if planned_op else 0.0
    stepwise = statistics.median(makespan(durations) for durations in per_step)
    return Replay(planned.makespan, makespan(medians), measured, stepwise, _ratios(kinds), _ratios(passes))


_PASSES = {"B": "B+W", "W": "B+W", "BW": "B+W"}


def _ratios(totals: dict[str, list[float]]) -> dict[str, float]:
    return {kind: measured / predicted - 1 for kind, (measured, predicted) in totals.items() if predicted > 0}


def replay_records(schedule: Schedule, costs: Costs, steps: Sequence[Sequence]) -> Replay:
    """`replay` of a run's records: `steps[k][d]`, device d's record of the k-th step kept (its
    `ops`, seconds from its own start, and `began`, on the clock the machine's processes share).
    Each step's devices are put on one clock, from the first of them to begin."""
    per_device: list[list[list[OpRecord]]] = [[] for _ in range(schedule.num_devices)]
    for records in steps:
        first = min(record.began for record in records)
        for device, record in enumerate(records):
            shift = record.began - first
            per_device[device].append([(text, 1e3 * (shift + a), 1e3 * (shift + b)) for text, a, b in record.ops])
    return replay(schedule, costs, per_device)
