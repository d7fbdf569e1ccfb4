"""A plan priced again under another profile (`tune.plan.repriced`): its own schedule, timed anew."""

import pytest

from pipeloom.tune.plan import plan_from_evaluation, repriced
from pipeloom.tune.profiled import ProfiledCostModel
from pipeloom.tune.search import tune

from .test_profiled import plain, profile, with_speed
from .test_speed_noise import JUMPY

PASS_KINDS = ("F", "B", "W", "R")


def _plan(data: dict, memory: float = 1e9, **space):
    cost_model = ProfiledCostModel(data)
    result = tune(cost_model, 2, memory, 8, micro_batches=[2], layouts=False, **space)
    return plan_from_evaluation(result.best, result, cost_model.model, cost_model.to_dict()), cost_model


@pytest.mark.parametrize(
    "space",
    [
        {"schemes": ["zb-v"], "pp_values": [2]},
        {"schemes": ["zb-auto"], "pp_values": [2]},  # budgeted: built to the memory the tuner had
        {"schemes": ["svpp"], "pp_values": [2]},
        {"schemes": ["1f1b"], "pp_values": [1]},  # dp = 2: the gradients' all-reduce and the replicas' skew
    ],
)
def test_a_plan_priced_under_its_own_profile_predicts_what_tune_did(space):
    data = with_speed(profile(), step=JUMPY)
    plan, cost_model = _plan(data, **space)
    _same(plan, cost_model)


@pytest.mark.parametrize(
    ("space", "static", "activations", "taken"),
    [
        ({"schemes": ["1f1b"], "pp_values": [1]}, 0.95, 1.0, {"zero": 1, "passes": ()}),  # only sharding fits
        ({"schemes": ["1f1b"], "pp_values": [2]}, 1.0, 0.85, {"zero": 0, "passes": ("mario",)}),  # checkpointing
    ],
)
def test_a_plan_a_memory_limit_shaped_is_priced_with_its_measure(space, static, activations, taken):
    data = with_speed(profile(), step=JUMPY)
    unshaped, _ = _plan(data, **space, static_measures=False)
    memory = static * max(unshaped.predicted["static_memory"]) + activations * max(
        unshaped.predicted["peak_activation_memory"]
    )
    plan, cost_model = _plan(data, memory, **space)
    assert {"zero": plan.zero, "passes": plan.passes} == taken
    _same(plan, cost_model)


def _same(plan, cost_model) -> None:
    again = repriced(plan, cost_model).predicted
    for key in ("step_time_ms", "pipeline_ms", "allreduce_ms", "optimizer_ms", "speed_noise_ms", "bubble_rate"):
        assert again[key] == pytest.approx(plan.predicted[key], rel=1e-12, abs=1e-12), key
    assert again["peak_memory"] == pytest.approx(plan.predicted["peak_memory"])


def test_ops_a_tenth_dearer_make_the_same_schedule_s_pipeline_a_tenth_longer():
    free_p2p = {
        "links": profile()["links"] | {"p2p": {"latency_ms": 0.0, "bytes_per_ms": 1e300}}
    }  # only the ops take time
    plan, _ = _plan(profile() | free_p2p, schemes=["zb-h1"], pp_values=[2])
    slower = profile() | free_p2p
    for fits in plain(slower)["fits"].values():
        for kind in PASS_KINDS:
            fits[kind] = {position: 1.1 * value for position, value in fits[kind].items()}
    again = repriced(plan, ProfiledCostModel(slower)).predicted
    assert again["pipeline_ms"] == pytest.approx(1.1 * plan.predicted["pipeline_ms"], rel=1e-9)
    assert again["optimizer_ms"] == pytest.approx(plan.predicted["optimizer_ms"])  # not an op: unchanged
