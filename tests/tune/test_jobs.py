"""The tuner on several processes: the same ranking, rejections and counts as on one."""

import pickle

import pytest

from pipeloom.costs import Costs
from pipeloom.schedules import build_schedule
from pipeloom.sim.simulate import simulate
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.pool import ROUND
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import tune

GIB = 2**30
MODEL = AnalyticCostModel(load_model("zb-1.5b"), load_hardware("rtx-4090"))
SPACE = {"schemes": ["1f1b", "zb-h1", "interleaved", "chimera", "zb-v"], "micro_batches": [1, 2, 4]}
"""Chunked, mirrored and V layouts through the workers; svpp is left out (its search takes ten
times the others' and goes through the same worker code)."""


def _outcome(result):
    ranked = [
        (e.candidate.label, e.step_time, e.peak_memory, e.bubble_rate, e.schedule.to_text()) for e in result.ranked
    ]
    rejected = sorted((e.candidate.label, e.reason) for e in result.rejected)
    return ranked, rejected, result.evaluated, result.pruned


def test_two_jobs_rank_exactly_as_one():
    """One tight budget covers every path a worker's answer takes: kept, fallen back, rejected."""
    one = tune(MODEL, 8, 8 * GIB, 16, keep=5, jobs=1, **SPACE)
    two = tune(MODEL, 8, 8 * GIB, 16, keep=5, jobs=2, **SPACE)
    assert one.ranked and one.rejected
    assert _outcome(two) == _outcome(one)
    assert one.evaluated + one.pruned > ROUND  # more than one round: later rounds prune against earlier ones
    for evaluation in two.ranked:  # a worker leaves timelines out; the search rebuilds the kept ones
        assert evaluation.timeline.makespan == pytest.approx(evaluation.pipeline_time)


def test_a_schedule_keeps_its_graph_but_does_not_pickle_it():
    schedule = build_schedule("1f1b", 4, 8)
    first = simulate(schedule, Costs(F=1, B=2))
    assert simulate(schedule, Costs(F=2, B=3)).graph is first.graph  # built once for any costs
    copy = pickle.loads(pickle.dumps(schedule))
    assert copy == schedule and copy._graph is None
    assert simulate(copy, Costs(F=2, B=3)).makespan == simulate(schedule, Costs(F=2, B=3)).makespan


def test_a_worker_sends_back_the_schedule_of_any_plan_that_beats_the_threshold():
    """The search ranks a plan faster than the last one ranked by any margin; a worker that kept
    only those faster by 1e-9 ms sent one back without its schedule, which it could not restore."""
    from copy import copy

    from pipeloom.tune.evaluation import packed, restore
    from pipeloom.tune.search import evaluate
    from pipeloom.tune.space import Candidate

    simulated = evaluate(Candidate("1f1b", 4, 2, 1, 8), MODEL, 24 * GIB)
    assert simulated.feasible
    step = simulated.step_time
    just_faster, _ = packed((copy(simulated), True), threshold=step * (1 + 1e-15) + 1e-12)
    assert just_faster.schedule is not None and just_faster.timeline is None
    restore(just_faster)
    assert just_faster.timeline is not None and just_faster.timeline.makespan == simulated.timeline.makespan
    as_slow, _ = packed((copy(simulated), True), threshold=step)
    assert as_slow.schedule is None  # it cannot enter the ranking
