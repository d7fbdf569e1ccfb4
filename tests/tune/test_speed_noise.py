"""The median step under the ranks' step-to-step speed noise (`tune.speed_noise`)."""

from types import SimpleNamespace

import pytest

from pipeloom.profile.speed import QUANTILES, op_ratios, speed_quantiles
from pipeloom.profile.steadiness import steady_steps, timed_steps
from pipeloom.tune.profiled import ProfiledCostModel
from pipeloom.tune.search import tune
from pipeloom.tune.speed_noise import mean_matched, noisy_pipeline, winsorized

from .test_profiled import links, profile, with_speed

SPACE = dict(micro_batches=[2], layouts=False, keep=3)
STEADY = [1.0] * QUANTILES
JUMPY = [0.8 + 0.4 * k / (QUANTILES - 1) for k in range(QUANTILES)]  # uniform ±20 %, median 1


def _model(quantiles) -> ProfiledCostModel:
    return ProfiledCostModel(with_speed(profile(), step=quantiles))


def test_quantiles_are_each_step_over_its_series_median():
    series = [[100.0, 100.0, 150.0, 100.0]] * 3 + [[10.0, 12.0, 8.0, 10.0]] * 3
    quantiles = speed_quantiles(series)
    assert len(quantiles) == QUANTILES and quantiles[0] == pytest.approx(0.8) and quantiles[-1] == pytest.approx(1.5)
    assert quantiles[QUANTILES // 2] == pytest.approx(1.0) and quantiles == sorted(quantiles)
    assert speed_quantiles([[1.0, 2.0]]) == []  # too few steps to say


def test_a_short_profile_still_has_its_spread():
    """The README's quick start times four steps a probe and rank: 16 factors, fewer than the 21
    quantiles kept, read linearly between them rather than dropped (which priced no speed noise)."""
    series = [[100.0, 95.0, 105.0, 140.0], [10.0, 10.0, 9.5, 14.0]] * 2  # one step in four slow
    quantiles = speed_quantiles(series)
    factors = [step / 102.5 for step in series[0]] + [step / 10.0 for step in series[1]]  # over each median
    assert len(quantiles) == QUANTILES and quantiles[0] == pytest.approx(min(factors))
    assert quantiles[-1] == pytest.approx(max(factors)) and quantiles[QUANTILES // 2] == pytest.approx(1.0)
    assert tune(_model(quantiles), 2, 1e9, 8, schemes=["1f1b"], pp_values=[2], **SPACE).best.noise_time > 0


def test_steady_ranks_change_nothing_and_one_stage_feels_no_coupling():
    steady = tune(_model(STEADY), 2, 1e9, 8, schemes=["1f1b"], pp_values=[2], **SPACE).best
    assert steady.noise_time == pytest.approx(0.0, abs=1e-9)
    alone = tune(_model(JUMPY), 2, 1e9, 8, schemes=["1f1b"], pp_values=[1], **SPACE).best
    assert alone.noise_time == pytest.approx(0.0, abs=1e-6 * alone.pipeline_time)  # the median factor is 1


def test_a_pipeline_waits_for_whichever_rank_was_slow():
    plain = tune(ProfiledCostModel(profile()), 2, 1e9, 8, schemes=["1f1b"], pp_values=[2], **SPACE).best
    noisy = tune(_model(JUMPY), 2, 1e9, 8, schemes=["1f1b"], pp_values=[2], **SPACE).best
    assert noisy.candidate == plain.candidate and noisy.noise_time > 0
    assert noisy.pipeline_time == pytest.approx(plain.pipeline_time + noisy.noise_time)
    assert noisy.noise_time < 0.2 * plain.pipeline_time  # never beyond the slowest factor's
    assert noisy_pipeline(noisy, JUMPY) == noisy_pipeline(noisy, JUMPY)  # the same draws every time


def test_skewed_op_times_lengthen_even_one_device_s_median_step():
    skewed = [1.0] * (QUANTILES - 6) + [1.1, 1.2, 1.3, 1.4, 1.5, 9.0]  # slow ops slower than fast ones fast
    data = with_speed(profile(), step=STEADY, op=skewed)
    alone = tune(ProfiledCostModel(data), 2, 1e9, 8, schemes=["1f1b"], pp_values=[1], **SPACE).best
    assert alone.noise_time > 0
    assert winsorized(skewed)[-1] == 1.5 and winsorized(skewed)[0] == 1.0  # the top bin: one op in twenty
    # the sum of the ops' median factors is 1: what is added is below the winsorized mean excess
    excess = sum(winsorized(skewed)) / QUANTILES - 1
    assert alone.noise_time < excess * (alone.pipeline_time - alone.noise_time)


def test_a_tensor_parallel_plan_draws_from_its_own_layout_s_speeds():
    """Collective waits inside a tp op vary and skew it: a layout measured on tp ranks keeps its
    own quantiles (`profile.layouts`), and its plans draw from them, not from the plain probes'."""
    skewed = [1.0] * (QUANTILES - 6) + [1.1, 1.2, 1.3, 1.4, 1.5, 9.0]
    data = with_speed(with_speed(profile() | links(), step=STEADY, op=STEADY), "tp2", step=STEADY, op=skewed)
    data["layouts"]["tp2"]["fits"] = {"2": {kind: {"per_layer": 1.0, "single": 0.5} for kind in "FBWR"}}
    plain = ProfiledCostModel(data, tp=2, sequence_parallel=True)  # "2+sp" not measured: the plain probes'
    assert speeds(data, 2, True) == (STEADY, STEADY, None)
    assert speeds(data, 2, False) == (STEADY, skewed, None)
    assert speeds(data, 1, False) == (STEADY, STEADY, None)
    layout = {**SPACE, "schemes": ["1f1b"], "pp_values": [1]}  # the cost models price tp = 2
    assert tune(plain, 2, 1e9, 8, **layout).best.noise_time == pytest.approx(0.0, abs=1e-9)
    assert tune(ProfiledCostModel(data, tp=2), 2, 1e9, 8, **layout).best.noise_time > 0


def test_an_expert_parallel_plan_draws_from_its_own_layout_s_speeds():
    """All-to-all waits inside the ops of replicas that share out the experts vary and skew them
    too: an ep > 1 plan draws from that layout's quantiles, others do not."""
    skewed = [1.0] * (QUANTILES - 6) + [1.1, 1.2, 1.3, 1.4, 1.5, 9.0]
    data = with_speed(with_speed(profile(), step=STEADY, op=STEADY), "ep2", step=STEADY, op=skewed)
    data["model"] = data["model"] | {"num_experts": 4, "num_experts_per_tok": 2}
    data["layouts"]["ep2"]["fits"] = {"2": {kind: {"per_layer": 1.0, "single": 0.5} for kind in "FBWR"}}
    assert speeds(data, 1, False, ep=2) == (STEADY, skewed, None)
    assert speeds(data, 1, False) == (STEADY, STEADY, None)
    data["layouts"]["ep2"]["speed"] = {}
    assert speeds(data, 1, False, ep=2) == (STEADY, STEADY, None)


def speeds(data: dict, tp: int, sequence_parallel: bool, ep: int = 1) -> tuple[list, list, float | None]:
    """The step and op quantiles and the op mean a plan of this layout draws from."""
    import dataclasses

    cost_model = ProfiledCostModel(data, tp, sequence_parallel)
    cost_model.model = dataclasses.replace(cost_model.model, expert_parallel=ep)
    speed = cost_model.layout_speed()
    return list(speed.step), list(speed.op), speed.op_mean


def test_one_device_s_ops_draw_the_mean_factor_the_profile_measured():
    """A step adds up many ops, so it carries their mean factor: the draws are scaled to it."""
    skewed = [1.0] * (QUANTILES - 6) + [1.1, 1.2, 1.3, 1.4, 1.5, 9.0]
    data = with_speed(profile(), step=STEADY, op=skewed)
    alone = tune(ProfiledCostModel(data), 2, 1e9, 8, schemes=["1f1b"], pp_values=[1], **SPACE).best
    drawn = noisy_pipeline(alone, STEADY, op_quantiles=skewed)
    assert noisy_pipeline(alone, STEADY, op_quantiles=skewed, op_mean=1.05) == pytest.approx(
        drawn * 1.05 / (sum(winsorized(skewed)) - (1.0 + 1.5) / 2) * (QUANTILES - 1)
    )  # one device, no messages: the makespan scales with every op
    even = with_speed(profile(), step=STEADY, op=JUMPY, op_mean=1.03)
    measured = tune(ProfiledCostModel(even), 2, 1e9, 8, schemes=["1f1b"], pp_values=[1], **SPACE).best
    assert noisy_pipeline(measured, STEADY, op_quantiles=JUMPY, op_mean=1.0) == noisy_pipeline(
        measured, STEADY, op_quantiles=JUMPY
    )  # quantiles that already draw the mean are kept
    assert measured.pipeline_time == pytest.approx(noisy_pipeline(measured, STEADY, op_quantiles=JUMPY) * 1.03)
    matched = mean_matched([0.9, 1.0, 1.1, 2.0], 1.0)
    assert sum(matched[1:-1]) + (matched[0] + matched[-1]) / 2 == pytest.approx(3.0)
    assert mean_matched([0.9, 1.1], None) == [0.9, 1.1]


def test_an_op_s_ratio_takes_its_step_s_speed_out():
    def record(*durations):
        return SimpleNamespace(ops=[(f"{k}F0", 0.0, d) for k, d in enumerate(durations)])

    # step 2 ran twice as slow throughout; in step 3 op 0 alone was slow
    ratios = op_ratios([record(1.0, 1.0), record(2.0, 2.0), record(1.5, 1.0), record(1.0, 1.0), record(1.0, 1.0)])
    assert ratios[:4] == pytest.approx([1.0, 1.0, 1.0, 1.0])  # a slow step is the step's factor, not the ops'
    assert ratios[4:6] == pytest.approx([1.2, 0.8])  # 1.5 and 1 ms in a step 1.25 times as long
    assert op_ratios([record(1.0)]) == []  # one step: nothing to compare


def test_steps_in_a_slow_spell_are_left_out_whatever_share_of_the_steps_it_took():
    """Steps measured here: rank 0 at about 155 ms, then a spell at 200 ms and one at 240 ms."""
    fast, slow = [160.0, 155.0, 162.0, 150.0, 158.0], [204.0, 198.0, 236.0, 241.0]
    for spell in (1, 4):  # one slow step or nearly half of them
        rank0 = fast + slow[:spell]
        rank1 = [100.0] * len(rank0)
        assert steady_steps([rank0, rank1]) == [True] * len(fast) + [False] * spell
    # a step is steady only where every rank was: rank 1's slow step goes too
    assert steady_steps([fast, [100.0, 100.0, 100.0, 130.0, 100.0]]) == [True, True, True, False, True]
    jitter = [100.0, 104.0, 97.0, 109.0, 101.0, 95.0]  # one speed throughout: all kept
    assert steady_steps([jitter]) == [True] * len(jitter)
    assert steady_steps([[100.0, 300.0]]) == [True, True]  # too few to tell a spell from the work
    assert steady_steps([[100.0, 300.0, 310.0, 320.0, 330.0]]) == [True] * 5  # a lone fast step is not a level


def test_a_round_is_timed_after_its_two_warm_up_steps_but_never_left_empty():
    assert timed_steps([312, 301, 286, 288, 289]) == [286, 288, 289]  # measured: +12 %, +5 %, then level
    assert timed_steps([312, 301]) == [301]
    assert timed_steps([312]) == [312]
    assert timed_steps([]) == []
