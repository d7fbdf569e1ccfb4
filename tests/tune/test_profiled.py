"""The profiled cost model: fits, interpolation in micro-batch size, and what it will not guess."""

import pytest

from pipeloom import ConfigError
from pipeloom.tune.profiled import PROFILE_FORMAT, ProfiledCostModel, fit_positions
from pipeloom.tune.search import tune

MODEL = {"name": "toy", "hidden": 64, "layers": 8, "heads": 4, "ffn": 128, "vocab": 100, "seq_len": 32, "gated": True}


def fit(per_layer, first, last):
    return {
        "per_layer": per_layer,
        "first": first,
        "last": last,
        "middle": min(first, last),
        "single": max(first, last),
    }


def profile():
    fits = {}
    for size in (1, 2):
        fits[str(size)] = {
            "F": fit(1.0 * size, 0.5, 1.5),
            "B": fit(1.0 * size, 0.5, 1.0),
            "W": fit(0.5 * size, 0.0, 0.2),
            "R": fit(1.1 * size, 0.5, 1.5),
            "M_B": fit(1000.0 * size, 100.0, 4000.0),
            "M_ckpt": fit(0.0, 50.0 * size, 50.0 * size),
            "p2p_ms": 0.1 * size,
        }
    return {
        "format": PROFILE_FORMAT,
        "model": MODEL,
        "fits": fits,
        "params": {"layer": 1000, "first": 500, "last": 600},
        "static_bytes_per_param": 16,
        "p2p_bandwidth": 1e6,
        "step_overhead": {"base_ms": 2.0, "per_param_ms": 0.0},
    }


def test_fit_positions_shares_one_slope():
    points = [("first", n, 2.0 * n + 1.0) for n in (1, 2, 4)] + [("last", n, 2.0 * n + 3.0) for n in (1, 2, 4)]
    assert fit_positions(points) == pytest.approx(
        {"per_layer": 2.0, "first": 1.0, "last": 3.0, "middle": 1.0, "single": 3.0}
    )


def test_stage_costs_follow_the_fits_and_interpolate():
    model = ProfiledCostModel(profile())
    costs = model.stage_costs([2, 3, 3], 2, 3, 1)
    assert costs.F == pytest.approx((2 * 2 + 0.5, 3 * 2 + 0.5, 3 * 2 + 1.5))
    assert costs.M_B == pytest.approx((2 * 2000 + 100, 3 * 2000 + 100, 3 * 2000 + 4000))
    assert costs.M_static == pytest.approx(((2000 + 500) * 16, 3000 * 16, (3000 + 600) * 16))
    assert model.stage_costs([4, 4], 4, 2, 1).F[0] == pytest.approx(4 * 4.0 + 0.5)  # extrapolated in mbs
    assert model.optimizer_time(1e6, 1) == 2.0


def test_the_tuner_leaves_slices_out_of_a_profile():
    result = tune(ProfiledCostModel(profile()), 2, 2**30, 4, schemes=["1f1b", "svpp"], micro_batches=[1, 2])
    assert all(e.candidate.slices == 1 for e in result.ranked)
    assert any(e.reason.startswith("cost model") for e in result.rejected)


def test_bad_profiles_are_refused():
    with pytest.raises(ConfigError, match="not a pipeloom.profile/1"):
        ProfiledCostModel({"format": "other"})
    with pytest.raises(ConfigError, match="incomplete"):
        ProfiledCostModel({"format": PROFILE_FORMAT, "model": MODEL})
    with pytest.raises(ConfigError, match="--tp 1"):
        ProfiledCostModel(profile(), tp=2)
