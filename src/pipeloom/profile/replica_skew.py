"""How long a data-parallel replica waits for the other: at the gradient sync, and at the loss's
all-reduce.

Two replicas run the same pipeline, but never at quite the same speed: at the first collective
after it the faster one waits, and again at the loss's all-reduce that ends the step. The profile
trains one stage on two replicas (ZeRO-0 and ZeRO-1, by turns) and takes rank 0's gradient
collectives, optimizer step and the rest of its step beyond what the links, the optimizer fit and
the probes' step overhead predict, as a share of its pipeline — the mean, not the median: a rank
waits only in the steps where it was the faster one. (Without the rest of the step, a dp = 2
plan ran 4.6–5.0 % longer than predicted in four runs of bench/fidelity.py, and that phase took
2.6–3.9 ms of its step against the 0.7–0.8 predicted.)

A wait is short and heavy-tailed, so a few steps' mean moves by several times itself: 8 steps
measured 0.03–0.14 of the pipeline here from one run to the next, which priced a dp = 2 plan's
step up to 15 % off. A slow spell of the host (`speed.steady_steps`) on one core makes the other
replica wait for its whole length, and the runs the prediction is judged against leave those
steps out — so the wait is taken over steady steps only, over several rounds, at the largest
micro-batch profiled (the plans' size; the least fixed cost per pipeline ms).
"""

from __future__ import annotations

import statistics
from itertools import compress

from pipeloom.profile.probe_rounds import ProbeModel, Turns, run_by_turns, steady_records
from pipeloom.profile.speed import timed_steps
from pipeloom.schedules.registry import build_schedule
from pipeloom.tune.profiled import ProfiledCostModel

__all__ = ["SKEW_ROUNDS", "replica_skews", "step_tail"]

SKEW_ROUNDS = 3
"""Rounds per ZeRO level, taking turns: a slow spell falls on one round of each."""
_ZERO_LEVELS = (0, 1)


def replica_skews(profile, probed: ProbeModel, mbs: int, layers: int, turns: Turns) -> dict[int, float]:
    """{0: share, 1: share}: the mean wait of rank 0 at ZeRO-0's and ZeRO-1's gradient sync
    and the loss's all-reduce, over its pipeline, on one stage of `layers` layers at micro-batch
    size `mbs`, each level's rounds taken by `turns`."""
    schedule = build_schedule("1f1b", 1, 4)
    specs = {zero: probed.spec(mbs, layers, stages=1, schedule=schedule, dp=2, zero=zero) for zero in _ZERO_LEVELS}
    measured, _ = run_by_turns(specs, turns)
    cost_model = ProfiledCostModel(profile)
    params = cost_model.stage_params([layers])[0]
    return {
        zero: _skew(
            measured[zero],
            cost_model.allreduce_time(params, 1, 2, zero)
            + cost_model.optimizer_time(params, 2, zero)
            + cost_model.step_overhead_time(),
        )
        for zero in _ZERO_LEVELS
    }


def _skew(rounds: list, expected_ms: float) -> float:
    """Rank 0's mean wait beyond `expected_ms` over its median pipeline, steady steps only."""
    tail, pipeline = step_tail(rounds, steady_records(rounds)[0])
    return max(0.0, tail - expected_ms) / pipeline


def step_tail(rounds: list, kept: list[list[bool]]) -> tuple[float, float]:
    """Rank 0's step beyond its pipeline — gradient sync, optimizer and the rest, where it waits
    for the other replica — its mean over the steps `kept` of `rounds` (per round, its steady
    steps: `probe_rounds.steady_records`), in ms; and its median pipeline (ms)."""
    tails, pipelines = [], []
    for results, flags in zip(rounds, kept):
        for phases in compress(timed_steps(results[0].phase_seconds), flags):
            tails.append(1e3 * (phases["allreduce"] + phases["optimizer"] + phases["overhead"]))
            pipelines.append(1e3 * phases["pipeline"])
    return statistics.fmean(tails), statistics.median(pipelines)
