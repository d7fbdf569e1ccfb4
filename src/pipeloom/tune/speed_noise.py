"""A pipeline's median step on a machine whose ranks change speed from step to step.

The simulator times a schedule on the median op times. On a machine whose ranks run some steps
markedly slower than others, and some ops slower than others within a step (`profile.speed`
measures both), each step of a pipeline waits for whichever rank was slow in it and each
cross-device dependency for the later of its two paths, and skewed op times make even one
device's median step longer than its median ops' sum. The leading plans are simulated again
under `DRAWS` draws of one speed factor per device and one per op, from the profile's quantiles
(from one seed for every plan, so that their order reflects their schedules, not the dice; the
devices' stratified, so that each sees every part of the distribution once; the ops' scaled to
the mean factor the profile measured, which a step of many ops carries), and their pipeline
takes the median makespan. A plan draws from the quantiles of its ranks' layout. A profile without
the quantiles changes nothing. `sim.replay` checks it against runs: each step's own ops replayed,
the median of those against the median ops'.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

from pipeloom.ir.walk import run
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.evaluation import Evaluation

__all__ = ["DRAWS", "noisy_pipeline", "apply_speed_noise", "mean_matched", "winsorized"]

DRAWS = 64
"""Steps drawn per plan."""


def noisy_pipeline(
    evaluation: Evaluation,
    quantiles: Sequence[float],
    draws: int = DRAWS,
    op_quantiles: Sequence[float] = (),
    op_mean: float | None = None,
) -> float:
    """The median pipeline over `draws` steps, each device's op times scaled by a factor drawn
    from `quantiles` (evenly spaced, fastest first) and each op's by one from `op_quantiles`,
    winsorized (`winsorized`) and, given the ops' measured mean factor `op_mean`, scaled to
    draw that mean (`mean_matched`)."""
    op_quantiles = mean_matched(winsorized(op_quantiles), op_mean)
    timeline = evaluation.timeline
    assert timeline is not None, "a ranked plan has its timeline"
    graph, costs = timeline.graph, timeline.costs
    base = [end - start for start, end in zip(timeline.start, timeline.end)]
    rng = random.Random(0)
    strata = []  # Latin hypercube: each device sees every one of the draws' strata once
    for _ in range(timeline.num_devices):
        order = list(range(draws))
        rng.shuffle(order)
        strata.append(order)
    makespans = []
    for k in range(draws):
        factors = [_draw((order[k] + 0.5) / draws, quantiles) for order in strata]
        durations = [duration * factors[graph.device_of[g]] for g, duration in enumerate(base)]
        if op_quantiles:
            durations = [duration * _draw(rng.random(), op_quantiles) for duration in durations]
        makespans.append(max(run(graph, durations, costs.comm)[1]))
    return statistics.median(makespans)


def apply_speed_noise(ranked: list[Evaluation], cost_model: CostModel) -> None:
    """Add each ranked plan's speed-noise cost to its pipeline (`Evaluation.noise_time`) and sort
    the ranking again; plans with offload lanes keep theirs (the lanes are timed on the host).
    The quantiles are those of the plan's ranks (`ProfiledCostModel.layout_speed`)."""
    speed = cost_model.layout_speed()
    if speed is None:  # an analytic cost model: nothing measured
        return
    quantiles, ops, op_mean = list(speed.step), list(speed.op), speed.op_mean
    if not quantiles:
        return
    for evaluation in ranked:
        if evaluation.offload is not None or evaluation.timeline is None:
            continue
        tax = noisy_pipeline(evaluation, quantiles, op_quantiles=ops, op_mean=op_mean) - evaluation.timeline.makespan
        evaluation.pipeline_time += tax
        evaluation.noise_time = tax
    ranked.sort(key=lambda evaluation: evaluation.step_time)


def winsorized(quantiles: Sequence[float]) -> list[float]:
    """The op quantiles with the extreme bins (below 5 %, above 95 %) held at their neighbours':
    those rest on a handful of the few hundred ops a profile times, and drawn independently for
    every op they would charge each step a stall that a step, measured, does not carry."""
    if len(quantiles) < 3:
        return list(quantiles)
    return [quantiles[1], *quantiles[1:-1], quantiles[-2]]


def mean_matched(quantiles: list[float], mean: float | None) -> list[float]:
    """`quantiles` scaled so that a factor drawn from them (`_draw`, linear between them) has
    `mean` on average; unchanged without one. Many ops add up to a step, so their factors' mean is
    what one device's median step carries, and 21 quantiles do not hold it (`docs/fidelity.md`)."""
    if not mean or len(quantiles) < 2:
        return quantiles
    drawn = (sum(quantiles) - (quantiles[0] + quantiles[-1]) / 2) / (len(quantiles) - 1)
    return [q * mean / drawn for q in quantiles]


def _draw(u: float, quantiles: Sequence[float]) -> float:
    """The factor at probability `u`, linear between the quantiles."""
    position = u * (len(quantiles) - 1)
    low = int(position)
    high = min(low + 1, len(quantiles) - 1)
    return quantiles[low] + (quantiles[high] - quantiles[low]) * (position - low)
