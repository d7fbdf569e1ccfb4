"""Costs have one meaning everywhere: a scalar is one device's share of the model (DESIGN §2)."""

import json

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate


def test_scalar_is_one_devices_share_split_over_its_chunks_and_slices():
    table = Costs(F=1.0, B=2.0, W=0.5, M_B=4.0).resolve(num_devices=4, num_stages=8, num_slices=2)
    assert table.F == [0.25] * 16  # 1 · p/S / L
    assert table.B == [0.5] * 16
    assert table.W == [0.125] * 16
    assert table.M_B == [1.0] * 16
    assert table.R == table.F  # R defaults to F


def test_a_fused_backward_is_one_op_priced_as_given_else_as_its_b_and_w():
    """A BW is one autograd pass: where its time is given, its communication and the runtime's
    time around an op count once (a B and a W apart pay that time twice), and the forward of its
    micro-batch takes F_BW; else B + W and F, as before they were measured."""
    apart = Costs(F=2.0, B=3.0, W=1.0, a2a_B=0.5, op_overhead=0.1).resolve(1, 1)
    assert apart.BW == pytest.approx([3.5 + 0.1 + 1.1]) and apart.F_BW is apart.F
    fused = Costs(F=2.0, B=3.0, W=1.0, BW=3.2, F_BW=1.8, a2a_B=0.5, op_overhead=0.1).resolve(1, 1)
    assert fused.BW == pytest.approx([3.2 + 0.5 + 0.1]) and fused.F_BW == pytest.approx([1.8 + 0.1])
    schedule = build_schedule("1f1b", 1, 2)  # F0 BW0 F1 BW1: each forward's backward fused
    costs = Costs(F=2.0, B=3.0, W=1.0, BW=3.2, F_BW=1.8)
    assert simulate(schedule, costs).makespan == pytest.approx(2 * (1.8 + 3.2))
    assert simulate(schedule, Costs(F=2.0, B=3.0, W=1.0)).makespan == pytest.approx(2 * (2.0 + 4.0))
    split = build_schedule("zb-h1", 2, 2)  # every F's backward split: F, not F_BW
    assert simulate(split, costs).makespan == simulate(split, Costs(F=2.0, B=3.0, W=1.0)).makespan


def test_per_stage_lists_are_exact_and_split_over_slices():
    table = Costs(F=[1, 2, 3], M_static=[5, 6, 7]).resolve(num_devices=3, num_stages=3, num_slices=2)
    assert table.F == [0.5, 0.5, 1.0, 1.0, 1.5, 1.5]
    assert table.M_static == [5, 6, 7]


def test_per_slice_values_are_exact():
    table = Costs(F=[[1, 3], [2, 4]]).resolve(num_devices=2, num_stages=2, num_slices=2)
    assert table.F == [1, 3, 2, 4]


@pytest.mark.parametrize(
    "kwargs, stages, message",
    [
        ({"F": [1, 2]}, 3, "F has 2 per-stage values but the schedule has 3 stages"),
        ({"B": [[1], [1]]}, 2, r"B\[0\] has 1 per-slice values but the schedule has 2 slices"),
    ],
)
def test_wrong_lengths_are_refused_with_the_fix(kwargs, stages, message):
    with pytest.raises(ConfigError, match=message):
        Costs(**kwargs).resolve(num_devices=2, num_stages=stages, num_slices=2)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"F": -1}, "F must be a non-negative finite number"),
        ({"M_B": float("nan")}, "M_B must be a non-negative finite number"),
        ({"B": "2"}, "B must be a number or a non-empty per-stage list"),
        ({"W": []}, "W must be a number or a non-empty per-stage list"),
        ({"F": [1, [1, "x"]]}, r"F\[1\] must be a number or a list of per-slice numbers"),
        ({"comm": -0.5}, "comm must be a non-negative number"),
    ],
)
def test_bad_values_are_refused(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        Costs(**kwargs)


def test_parse_spec_and_unknown_keys():
    assert Costs.parse("F=1,B=2,W=0,comm=0.5") == Costs(F=1, B=2, W=0, comm=0.5)
    with pytest.raises(ConfigError, match="unknown cost key"):
        Costs.parse("F=1,Q=2")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        Costs.parse("F=1,B")
    with pytest.raises(ConfigError, match="B must be a number"):
        Costs.parse("B=two")


def test_costs_file(tmp_path):
    path = tmp_path / "costs.json"
    path.write_text(json.dumps({"F": [1, 2], "B": 2, "comm": 0.1, "M_static": 3}))
    costs = Costs.load(path)
    assert costs.F == (1.0, 2.0) and costs.comm == 0.1
    assert Costs.from_mapping(costs.to_dict()) == costs
    path.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must be a JSON object"):
        Costs.load(path)
    with pytest.raises(ConfigError, match="cannot read costs file"):
        Costs.load(tmp_path / "nope.json")


def test_chunking_does_not_change_the_work_or_1f1b_memory():
    """Thus 1F1B's peak activation memory is p·M_B whatever the chunking (the issue's rule)."""
    costs = Costs(F=1, B=2, M_B=1)
    plain = simulate(build_schedule("1f1b", 4, 8), costs)
    chunked = simulate(build_schedule("interleaved", 4, 8, num_chunks=1), costs)
    assert plain.peak_memory == chunked.peak_memory == [4, 3, 2, 1]
    for v in (2, 4):
        timeline = simulate(build_schedule("interleaved", 4, 8, num_chunks=v), costs)
        assert timeline.useful_time == pytest.approx([8 * 3] * 4)  # m · (F + B) per device


def test_attention_makes_later_slices_cost_more():
    from pipeloom.costs import causal_attention_fraction

    costs = Costs(F=1, B=2, W=1, M_B=1, attention_fraction=0.1)
    weights = costs.slice_weights(4)
    assert sum(weights) == pytest.approx(1) and weights == sorted(weights) and weights[0] < weights[-1]
    table = costs.resolve(2, 2, 4)  # two stages of one device share each, four slices
    assert table.F[:4] == pytest.approx(weights) and table.B[:4] == pytest.approx([2 * w for w in weights])
    assert table.W[:4] == [0.25] * 4 and table.M_B[:4] == [0.25] * 4  # no attention in W, memory per token
    assert Costs(F=1).resolve(2, 2, 4).F[:4] == [0.25] * 4
    assert Costs(F=[2, 4], attention_fraction=1).resolve(2, 2, 2).F == [0.5, 1.5, 1.0, 3.0]
    assert round(causal_attention_fraction(5120, 4096, 13824), 3) == 0.062
    assert causal_attention_fraction(4096, 131072) > 0.5  # 128K context: attention dominates
    with pytest.raises(ConfigError, match="attention_fraction"):
        Costs(attention_fraction=1.5)
