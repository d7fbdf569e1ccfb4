"""The tuner: feasible whenever brute force finds a plan, Mario fits what 1F1B cannot, clear refusals."""

import pytest

from pipeloom import InfeasibleError
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.plan import Plan, plan_from_evaluation
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import evaluate, tune
from pipeloom.tune.space import Candidate, candidates

GIB = 2**30
SMALL = AnalyticCostModel(load_model("zb-1.5b"), load_hardware("rtx-4090"))
TINY_SPACE = {"schemes": ["1f1b", "zb-h1", "interleaved", "chimera", "tpipe"], "micro_batches": [1, 2, 4]}


@pytest.mark.parametrize("memory", [6, 8, 10, 14, 24])
def test_feasible_whenever_brute_force_finds_a_plan(memory):
    def run(exhaustive):
        try:
            return tune(SMALL, 8, memory * GIB, 16, exhaustive=exhaustive, keep=3, **TINY_SPACE)
        except InfeasibleError:
            return None

    pruned, brute = run(False), run(True)
    assert (pruned is None) == (brute is None)
    if brute is not None:
        assert pruned.best.step_time == pytest.approx(brute.best.step_time)
        assert pruned.best.candidate.label == brute.best.candidate.label
        assert max(brute.best.peak_memory) <= memory * GIB
        every = [evaluate(c, SMALL, memory * GIB) for c in candidates(8, 16, num_layers=22, **TINY_SPACE)]
        fits = [e for e in every if e.feasible]
        assert brute.best.step_time <= min(e.step_time for e in fits) + 1e-9  # other layouts may beat the balanced
        assert pruned.evaluated + pruned.pruned + len(pruned.rejected) >= len(every) - 1


@pytest.mark.parametrize("scheme", ["1f1b", "chimera"])
def test_mario_fits_what_the_plain_schedule_cannot_mario_table_5(scheme):
    """GPT3-13B on 32 A100-40G, global batch 128, micro-batch 2 (Mario Table 5: V-base and X-base OOM)."""
    model = AnalyticCostModel(load_model("gpt3-13b"), load_hardware("a100-40g"))
    space = {"schemes": [scheme], "pp_values": [32], "micro_batches": [2]}
    with pytest.raises(InfeasibleError, match="no plan fits 40.00 GiB"):
        tune(model, 32, 40 * GIB, 128, memory_passes=False, **space)
    result = tune(model, 32, 40 * GIB, 128, **space)
    assert result.best.candidate.passes == ("mario",)
    assert max(result.best.peak_memory) <= 40 * GIB
    plain = evaluate(Candidate(scheme, 32, 1, 2, 64), model, 40 * GIB, memory_passes=False, static_measures=False)
    assert not plain.feasible and max(plain.peak_memory) > 100 * GIB  # Table 5 measures 122 and 124 GB


def test_infeasible_requests_name_the_binding_constraint():
    model = AnalyticCostModel(load_model("gpt3-175b"), load_hardware("a100-40g"))
    with pytest.raises(InfeasibleError, match=r"no plan fits 40.00 GiB .*static"):
        tune(model, 8, 40 * GIB, 64, schemes=["1f1b"])
    with pytest.raises(InfeasibleError, match="divides the global batch"):
        tune(SMALL, 8, 24 * GIB, 3, schemes=["1f1b"], pp_values=[2])


def test_plan_round_trips(tmp_path):
    result = tune(SMALL, 8, 24 * GIB, 16, **TINY_SPACE)
    plan = plan_from_evaluation(result.best, result, SMALL.model, SMALL.to_dict())
    plan.save(tmp_path / "plan.json")
    back = Plan.load(tmp_path / "plan.json")
    assert back.schedule.devices == plan.schedule.devices and back.partition == plan.partition
    assert back.predicted == plan.predicted and back.costs == plan.costs
    assert sum(back.partition) == 22 and back.pp * back.dp == 8


def test_dualpipe_schemes_join_the_space_where_their_steps_fit():
    rejected: list = []
    points = list(candidates(8, 16, schemes=("dualpipe", "dualpipev"), micro_batches=(1, 2), rejected=rejected))
    shapes = {(c.scheme, c.pp, c.num_microbatches) for c in points}
    # dualpipe: pp even, m even and >= 2pp - 2; dualpipev: m >= 2pp - 1
    assert ("dualpipe", 4, 8) in shapes and ("dualpipe", 8, 16) in shapes and ("dualpipe", 8, 8) not in shapes
    assert ("dualpipev", 4, 8) in shapes and ("dualpipev", 8, 8) not in shapes and ("dualpipev", 1, 2) in shapes
    assert ("dualpipev pp=8 mbs=2", "8 micro-batches; it needs 15") in rejected
    dualpipe = next(c for c in points if c.scheme == "dualpipe" and c.pp == 4)
    assert dualpipe.placement == [[0, 3], [1, 2], [2, 1], [3, 0]] and dualpipe.replicas == 2
    dualpipev = next(c for c in points if c.scheme == "dualpipev" and c.pp == 4)
    assert dualpipev.num_stages == 8 and dualpipev.placement[0] == [0, 7] and dualpipev.replicas == 1


def test_the_pruning_bound_is_below_every_simulated_step():
    """The bound the tuner prunes on (each device's warm-up and work, plus the step around the
    pipeline) never exceeds the step a candidate is simulated to take, for every scheme: a bound
    above it would prune plans that could win."""
    from pipeloom.tune.search import _prepare
    from pipeloom.tune.space import DEFAULT_SCHEMES

    space, memory = {"schemes": list(DEFAULT_SCHEMES), "micro_batches": [1]}, 24
    checked = 0
    for candidate in candidates(8, 8, num_layers=22, **space):
        _, bound = _prepare(candidate, SMALL, memory * GIB)
        evaluation = evaluate(candidate, SMALL, memory * GIB)
        if evaluation.feasible:
            checked += 1
            assert bound <= evaluation.step_time * (1 + 1e-9), candidate.label
    assert checked >= 10


def test_the_layer_layout_is_chosen_with_the_schedule():
    """GPT3-13B's 128 layers on 8 stages: the balanced layout (fewest layers on the head's stage,
    the extra one on the first) is not the fastest under 1F1B; the tuner builds its leading plans
    on other layouts too and keeps the faster, whose layout the plan then carries."""
    from pipeloom.tune.partition import partition_variants

    model = AnalyticCostModel(load_model("gpt3-13b"), load_hardware("a100-40g"))
    space = {"schemes": ["1f1b"], "pp_values": [8], "micro_batches": [1], "keep": 1}
    balanced = tune(model, 64, 40 * GIB, 128, layouts=False, **space).best
    chosen = tune(model, 64, 40 * GIB, 128, **space).best
    assert chosen.step_time < balanced.step_time * 0.99
    assert chosen.partition in partition_variants(balanced.partition) and sum(chosen.partition) == 128
    plan = plan_from_evaluation(chosen, tune(model, 64, 40 * GIB, 128, **space), model.model, model.to_dict())
    assert list(plan.partition) == chosen.partition


def test_the_room_floor_is_below_every_budgeted_step_and_prunes_where_memory_binds():
    """Budgeted schemes under tight memory: the bound with the room floor (micro-batches in
    flight capped by the activation room) is still below every simulated step, and above the
    work-and-warm-up floor where memory binds."""
    from pipeloom.tune.bounds import pipeline_floor
    from pipeloom.tune.search import _prepare

    space = {"schemes": ["zb-auto", "zb-v", "svpp"], "micro_batches": [2, 4], "pp_values": [8]}
    checked = raised = 0
    for memory in (7, 12):
        for candidate in candidates(8, 32, num_layers=22, **space):
            evaluation = evaluate(candidate, SMALL, memory * GIB)
            if not evaluation.feasible:
                continue
            prepared, bound = _prepare(candidate, SMALL, memory * GIB)
            assert bound <= evaluation.step_time * (1 + 1e-9), candidate.label
            fitting = [option for option in prepared.options if max(option.static_memory) <= memory * GIB]
            extra = min(option.allreduce_time + option.optimizer_time for option in fitting)
            raised += bound > pipeline_floor(candidate, prepared.costs) + extra + prepared.overhead_time + 1e-9
            checked += 1
    assert checked >= 10 and raised >= 2


def test_the_memory_floor_is_below_every_placement_of_w_parts():
    """The tuner skips W parts on a schedule whose floor (every B freeing its activations whole)
    is over the limit: a floor above any W-parts placement would rule out plans that fit."""
    import random

    from pipeloom import Costs, build_schedule, simulate
    from pipeloom.passes.weight_parts import weight_parts
    from pipeloom.tune.bounds import memory_floor

    rng = random.Random(4)
    for _ in range(12):
        p = rng.randint(2, 5)
        m = rng.randint(1, 3 * p)
        costs = Costs(F=1.0, B=rng.uniform(0.5, 2), W=rng.uniform(0.2, 1.5), M_W=rng.uniform(0, 1), M_static=0.5)
        name = rng.choice(["svpp", "zb-h1", "1f1b", "zb-v"])
        schedule = build_schedule(name, p, m, costs=costs) if name in ("svpp", "zb-v") else build_schedule(name, p, m)
        floor = memory_floor(schedule, costs)
        for limit in (None, max(simulate(schedule, costs).peak_activation_memory) * 0.8):
            placed = simulate(weight_parts(schedule, costs, mem_limit=limit), costs).peak_memory
            assert all(low <= peak + 1e-9 for low, peak in zip(floor, placed)), (name, p, m)
