"""A pipeline's median step on a machine whose ranks change speed from step to step.

The simulator times a schedule on the median op times. On a machine whose ranks run some steps
markedly slower than others (`profile.speed` measures how much), each step of a pipeline waits
for whichever rank was slow in it, so the median step is longer — more so the more a schedule
couples its devices. The leading plans are simulated again under `DRAWS` draws of one speed
factor per device, from the profile's quantiles (the same draws for every plan, so that their
order reflects their schedules, not the dice; stratified, so that each device sees every part of
the distribution once and 64 draws pin the median well), and their pipeline takes the median makespan.
One stage, or a profile without the quantiles: nothing changes.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

from pipeloom.ir.walk import run
from pipeloom.tune.evaluation import Evaluation

__all__ = ["DRAWS", "noisy_pipeline", "apply_speed_noise"]

DRAWS = 64
"""Steps drawn per plan."""


def noisy_pipeline(evaluation: Evaluation, quantiles: Sequence[float], draws: int = DRAWS) -> float:
    """The median pipeline over `draws` steps, each device's op times scaled by a factor drawn
    from `quantiles` (evenly spaced, fastest first)."""
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
        makespans.append(max(run(graph, durations, costs.comm)[1]))
    return statistics.median(makespans)


def apply_speed_noise(ranked: list[Evaluation], cost_model) -> None:
    """Add each ranked plan's speed-noise cost to its pipeline (`Evaluation.noise_time`) and sort
    the ranking again; plans with offload lanes keep theirs (the lanes are timed on the host)."""
    quantiles = (getattr(cost_model, "profile", None) or {}).get("step_speed") or []
    if not quantiles:
        return
    for evaluation in ranked:
        if evaluation.offload is not None or evaluation.timeline is None:
            continue
        tax = noisy_pipeline(evaluation, quantiles) - evaluation.timeline.makespan
        evaluation.pipeline_time += tax
        evaluation.noise_time = tax
    ranked.sort(key=lambda evaluation: evaluation.step_time)


def _draw(u: float, quantiles: Sequence[float]) -> float:
    """The factor at probability `u`, linear between the quantiles."""
    position = u * (len(quantiles) - 1)
    low = int(position)
    high = min(low + 1, len(quantiles) - 1)
    return quantiles[low] + (quantiles[high] - quantiles[low]) * (position - low)
