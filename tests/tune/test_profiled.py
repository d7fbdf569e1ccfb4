"""The profiled cost model: fits, interpolation in micro-batch size, and what it will not guess."""

import dataclasses
import math

import pytest

from pipeloom import ConfigError
from pipeloom.profile_format import PROFILE_FORMAT
from pipeloom.schedules.registry import build_schedule
from pipeloom.tune.profile_fits import fit_positions
from pipeloom.tune.profiled import ProfiledCostModel
from pipeloom.tune.search import tune
from pipeloom.tune.topology import Split

LINKS = ("p2p", "allreduce", "reduce_scatter", "all_gather")
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
            "M_W": fit(0.0, 0.0, 0.0),
            "M_ckpt": fit(0.0, 50.0 * size, 50.0 * size),
        }
    return {
        "format": PROFILE_FORMAT,
        "model": MODEL,
        "layouts": {"plain": {"fits": fits}},
        "params": {"layer": 1000, "first": 500, "last": 600},
        "static_bytes_per_param": 16,
        "links": {name: {"latency_ms": 0.0, "bytes_per_ms": 1e6} for name in LINKS},
        "overheads": {"optimizer": {"base_ms": 2.0, "per_param_ms": 0.0}},
    }


def plain(data: dict) -> dict:
    """The plain layout's part of a profile dict."""
    return data["layouts"]["plain"]


def with_speed(data: dict, layout: str = "plain", **speed) -> dict:
    """`data` with `speed` (step, op, op_mean quantiles) set on `layout`'s measurements."""
    data["layouts"].setdefault(layout, {}).setdefault("speed", {}).update(speed)
    return data


def test_fit_positions_shares_one_slope():
    points = [("first", n, 2.0 * n + 1.0) for n in (1, 2, 4)] + [("last", n, 2.0 * n + 3.0) for n in (1, 2, 4)]
    assert fit_positions(points) == pytest.approx(
        {"per_layer": 2.0, "first": 1.0, "last": 3.0, "middle": 1.0, "single": 3.0}
    )


def test_noise_never_fits_a_layer_below_zero():
    points = [("first", 1, 2.0), ("first", 2, 1.0), ("last", 1, 4.0), ("last", 2, 3.0)]  # jitter above the layers
    assert fit_positions(points) == pytest.approx(
        {"per_layer": 0.0, "first": 1.5, "last": 3.5, "middle": 1.5, "single": 3.5}
    )


def test_a_steeper_position_never_drives_another_intercept_below_zero():
    """The failure a busy CI machine once produced: one position's layers look far dearer than the
    other's, and the shared slope would leave the cheaper position's intercept negative. The fit
    is the least squares under slope ≥ 0 and intercepts ≥ 0 — no slope on a fine grid does better."""
    points = [("first", 1, 1.0), ("first", 2, 5.0), ("last", 1, 0.2), ("last", 2, 0.3), ("last", 1, 0.25)]
    fit = fit_positions(points)
    assert min(fit.values()) >= 0.0 and fit["last"] == 0.0

    def residual(slope: float) -> float:
        by_position = {pos: [(n, v) for q, n, v in points if q == pos] for pos in ("first", "last")}
        total = 0.0
        for xs in by_position.values():
            intercept = max(0.0, sum(v - slope * n for n, v in xs) / len(xs))
            total += sum((v - slope * n - intercept) ** 2 for n, v in xs)
        return total

    best_on_grid = min(residual(k / 1000) for k in range(5000))
    assert residual(fit["per_layer"]) <= best_on_grid + 1e-12


def test_stage_costs_follow_the_fits_and_interpolate():
    model = ProfiledCostModel(profile())
    costs = model.stage_costs([2, 3, 3], 2, 3, 1)
    assert costs.F == pytest.approx((2 * 2 + 0.5, 3 * 2 + 0.5, 3 * 2 + 1.5))
    assert costs.M_B == pytest.approx((2 * 2000 + 100, 3 * 2000 + 100, 3 * 2000 + 4000))
    assert costs.M_static == pytest.approx(((2000 + 500) * 16, 3000 * 16, (3000 + 600) * 16))
    assert model.stage_costs([4, 4], 4, 2, 1).F[0] == pytest.approx(4 * 4.0 + 0.5)  # extrapolated in mbs
    assert model.optimizer_time(1e6, 1) == 2.0


def test_a_slice_is_priced_as_a_smaller_micro_batch():
    """A slice of a micro-batch of 2 in 2 slices costs what the fits say of a micro-batch of 1:
    it keeps its fixed costs (the intercepts), not half of them."""
    model = ProfiledCostModel(profile())
    whole, sliced = model.stage_costs([2, 2], 1, 2, 1), model.stage_costs([2, 2], 2, 2, 1, slices=2)
    table = sliced.resolve(2, 2, 2)
    assert table.F == pytest.approx([whole.F[0]] * 2 + [whole.F[1]] * 2)
    assert table.M_B == pytest.approx([whole.M_B[0]] * 2 + [whole.M_B[1]] * 2)
    assert sliced.comm == whole.comm
    result = tune(model, 2, 2**30, 4, schemes=["svpp"], micro_batches=[2])
    assert result.best.candidate.slices > 1


def test_a_sliced_plan_is_priced_from_the_probes_run_in_its_slices_where_the_profile_ran_them():
    """`profile --slices 2` measured each op of a micro-batch cut in two: a plan in two slices
    takes those ops (read at the micro-batch's own size), is priced as measured (no mark), and one
    in four slices, never run, is still priced as micro-batches of 1/4 and marked."""
    from pipeloom.profile_format import Fit, Layout, LayoutProfile, Profile

    plain = Profile.from_dict(profile())
    kinds = ("F", "B", "W", "R", "M_B", "M_ckpt", "M_W")
    sliced_fits = {
        size: {kind: Fit(7.0 * size, 3.0, first=1.0, last=3.0, middle=1.0) for kind in kinds} for size in (1, 2)
    }
    measured = dataclasses.replace(plain, layouts={**plain.layouts, Layout(slices=2): LayoutProfile(fits=sliced_fits)})
    model = ProfiledCostModel(measured)
    table = model.stage_costs([2, 3], 2, 2, 1, slices=2).resolve(2, 2, 2)
    assert table.F == pytest.approx([2 * 14.0 + 1.0] * 2 + [3 * 14.0 + 3.0] * 2)  # each slice as measured
    assert table.M_W == pytest.approx([2 * 14.0 + 1.0] * 2 + [3 * 14.0 + 3.0] * 2)
    assert model.extrapolations(2, slices=2) == [] and model.extrapolations(4, slices=2)[0].startswith(
        "micro-batch size 4 (profiled in 2 slices: 1, 2)"
    )
    assert model.extrapolations(2, slices=4)[0].startswith("4 slices (never profiled")
    unmeasured = ProfiledCostModel(plain).stage_costs([2, 3], 2, 2, 1, slices=2).resolve(2, 2, 2)
    assert unmeasured.F == pytest.approx([2 * 1.0 + 0.5] * 2 + [3 * 1.0 + 1.5] * 2)  # plain fits at size 1
    assert ProfiledCostModel(measured).stage_costs([2, 3], 2, 2, 1) == ProfiledCostModel(plain).stage_costs(
        [2, 3], 2, 2, 1
    )


def test_bad_profiles_are_refused():
    with pytest.raises(ConfigError, match="not a pipeloom.profile/2 file, but a other one"):
        ProfiledCostModel({"format": "other"})
    with pytest.raises(ConfigError, match=r"not a pipeloom.profile/2 file \(run"):
        ProfiledCostModel([])
    with pytest.raises(
        ConfigError, match=r"a pipeloom\.profile/1 file, .*: measure this machine again \(`pipeloom profile"
    ):
        ProfiledCostModel({"format": "pipeloom.profile/1", "model": MODEL, "fits": {}})
    with pytest.raises(ConfigError, match="`pipeloom profile --model hf:./mine --output profile.json`"):
        ProfiledCostModel({"format": "pipeloom.profile/1", "model": MODEL, "source": "hf:./mine"})
    with pytest.raises(ConfigError, match="incomplete"):
        ProfiledCostModel({"format": PROFILE_FORMAT, "model": MODEL})
    with pytest.raises(ConfigError, match="--tp must be at least 1"):
        ProfiledCostModel(profile(), tp=0)


def test_measured_runtime_overheads_are_priced():
    """A profile with the runtime's measured overheads: every op pays the per-op overhead, p2p is
    latency + bytes / bandwidth, the dp = 2 all-reduce scales by the ring, and the optimizer and
    the rest of a step are apart."""
    measured = profile() | {
        "links": {
            "p2p": {"latency_ms": 0.5, "bytes_per_ms": 1e6},
            "allreduce": {"latency_ms": 1.0, "bytes_per_ms": 2e6},
            "reduce_scatter": {"latency_ms": 2.0, "bytes_per_ms": 1e6},
            "all_gather": {"latency_ms": 0.5, "bytes_per_ms": 4e6},
        },
        "overheads": {
            "op_ms": 0.25,
            "optimizer": {"base_ms": 1.0, "per_param_ms": 1e-3},
            "step": {"base_ms": 3.0, "per_param_ms": 0.0},
        },
    }
    plain, model = ProfiledCostModel(profile()), ProfiledCostModel(measured)
    for key in ("F", "B", "W", "R"):
        assert getattr(model.stage_costs([2, 2], 1, 2, 1).resolve(2, 2), key) == pytest.approx(
            [t + 0.25 for t in getattr(plain.stage_costs([2, 2], 1, 2, 1).resolve(2, 2), key)]
        )
    assert model.stage_costs([2, 2], 2, 2, 1).comm == pytest.approx(0.5 + 4 * 2 * 32 * 64 / 1e6)
    assert model.allreduce_time(1000, 2, 1) == 0.0
    assert model.allreduce_time(1000, 2, 2) == pytest.approx(1.0 + 4000 / 2e6)  # what was measured
    assert model.allreduce_time(1000, 2, 4) == pytest.approx(3 * 1.0 + 1.5 * 4000 / 2e6)  # the ring
    assert model.allreduce_time(1000, 2, 2, zero=1) == pytest.approx(2.0 + 4000 / 1e6 + 0.5 + 4000 / 4e6)
    assert model.optimizer_time(1000, 2) == pytest.approx(2.0)
    assert model.optimizer_time(1000, 2, zero=1) == pytest.approx(1.5)  # this rank's shard
    assert model.step_overhead_time() == 3.0 and plain.step_overhead_time() == 0.0
    best = tune(model, 2, 2**30, 4, schemes=["1f1b"], pp_values=[2], micro_batches=[1]).best
    assert best.overhead_time == 3.0
    assert best.step_time == pytest.approx(best.pipeline_time + best.allreduce_time + best.optimizer_time + 3.0)


def links():
    """Measured collectives (over dp = 2), to merge into a profile dict."""
    line = {"latency_ms": 0.1, "bytes_per_ms": 1e5}
    return {"links": {name: line for name in LINKS}}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallelism_splits_compute_and_adds_its_measured_collectives(sequence_parallel):
    whole = ProfiledCostModel({**profile(), **links()})
    split = ProfiledCostModel({**profile(), **links()}, tp=2, sequence_parallel=sequence_parallel)
    one, two = whole.stage_costs([2, 3, 3], 2, 3, 1), split.stage_costs([2, 3, 3], 2, 3, 1)
    activation = 4 * 2 * MODEL["seq_len"] * MODEL["hidden"]  # fp32 bytes of one micro-batch's hidden states
    ring = 0.1 + activation / 1e5  # measured on 2 ranks: a tp = 2 group's collectives as they are
    for stage, layers in enumerate([2, 3, 3]):
        names = split.tp_collectives(stage, 3, layers)
        assert two.F[stage] == pytest.approx(one.F[stage] / 2 + ring * len(names["F"]))
        assert two.B[stage] == pytest.approx(one.B[stage] / 2 + ring * len(names["B"]))
        assert two.W[stage] == pytest.approx(one.W[stage] / 2)  # W stays local
        per_layer = (4 if sequence_parallel else 2) * layers
        assert len(names["F"]) == per_layer + (stage == 0) + (stage == 2) * sequence_parallel + (
            0 if sequence_parallel else stage > 0
        )
    assert two.M_static == pytest.approx([m / 2 for m in one.M_static])
    assert split.stage_params([2, 3, 3]) == pytest.approx([p / 2 for p in whole.stage_params([2, 3, 3])])
    asked = ProfiledCostModel({**profile(), **links()}, sequence_parallel=sequence_parallel)  # as `tune` loads it
    assert asked.with_split(Split(tp=2)).sequence_parallel == sequence_parallel  # kept for its tp splits


def test_ops_measured_on_tensor_parallel_ranks_are_priced_as_measured():
    """A profile that measured a layout on tp ranks (`profile --tp`) prices its ops from that:
    slope and single-stage intercept as measured, another position's intercept the tp = 1 one
    scaled as the single stage's, no collectives added (they are inside the measured times);
    another layout, not measured, keeps the split-and-add estimate."""
    data = {**profile(), **links()}
    measured = {kind: {"per_layer": 4.0 * k, "single": 3.0 * k} for k, kind in enumerate("FBWR", start=1)}
    tp2 = {"1": measured, "2": {k: {f: 2 * v for f, v in fit.items()} for k, fit in measured.items()}}
    data["layouts"]["tp2"] = {"fits": tp2}
    split = ProfiledCostModel(data, tp=2)
    single = split.stage_costs([3], 2, 1, 1)
    assert single.F == pytest.approx([3 * 8.0 + 6.0]) and single.W == pytest.approx([3 * 24.0 + 18.0])
    staged = split.stage_costs([2, 3], 1, 2, 1)
    # tp = 1 intercepts of F: first 0.5, last 1.5, single 1.5 — measured single 3.0 scales them by 2
    assert staged.F == pytest.approx([2 * 4.0 + 1.0, 3 * 4.0 + 3.0])
    assert split.layer_time(1) == pytest.approx(4.0 + 8.0 + 12.0)
    unmeasured = ProfiledCostModel({**profile(), **links()}, tp=2).stage_costs([3], 2, 1, 1)
    assert single.M_B == pytest.approx(unmeasured.M_B)  # no stash measured: the estimate's share
    tp2["2"]["M_B"] = {"per_layer": 700.0, "single": 900.0}
    tp2["1"]["M_B"] = {"per_layer": 350.0, "single": 450.0}
    stashed = ProfiledCostModel(data, tp=2)
    assert stashed.stage_costs([3], 2, 1, 1).M_B == pytest.approx([3 * 700.0 + 900.0])  # the stash as measured
    estimated = ProfiledCostModel(data, tp=2, sequence_parallel=True)  # "2+sp" was not measured
    assert estimated.stage_costs([3], 2, 1, 1).F != single.F
    tp2["1"]["F"]["single"] = -1.0
    with pytest.raises(ConfigError, match=r"layouts\.tp2\.fits\[1\]\.F\.single is -1.0"):
        ProfiledCostModel(data, tp=2)


def test_sequence_parallelism_s_second_sum_is_priced_as_its_probes_measured_it():
    """Under sequence parallelism each tp rank took the norms' gradients from its shard of the
    sequence: the runtime sums them over the tp ranks after the pipeline. The tp+sp probes' sync
    phase measured that sum ("sync": 0.5 ms a layer + 2 ms); a plan pays it on its busiest
    device, after the replicas' sync; without sequence parallelism there is none."""
    data = {**profile(), **links()}
    measured = {kind: {"per_layer": 1.0, "single": 1.0} for kind in "FBWR"} | {
        "sync": {"per_layer": 0.5, "single": 2.0}
    }
    for layout in ("tp2", "tp2+sp"):
        data["layouts"][layout] = {"fits": {"1": measured, "2": measured}}
    summed, plain = ProfiledCostModel(data, tp=2, sequence_parallel=True), ProfiledCostModel(data, tp=2)
    assert summed.tp_sum_time(6, 2) == pytest.approx(0.5 * 6 + 2.0) and plain.tp_sum_time(6, 2) == 0.0
    del data["layouts"]["tp2+sp"]  # not profiled: the norms' gradients all-reduced on the measured link
    norms = 4 * (2 * 6 + 1) * MODEL["hidden"]
    estimated = ProfiledCostModel(data, tp=2, sequence_parallel=True).tp_sum_time(6, 2)
    assert estimated == pytest.approx(0.1 + norms / 1e5)  # links(): 0.1 ms, 1e5 bytes/ms, measured on 2 ranks
    space = dict(schemes=["1f1b"], pp_values=[2], micro_batches=[2], static_measures=False)
    with_sum, without = (tune(model, 4, 1e12, 8, **space).best for model in (summed, plain))
    assert with_sum.candidate.dp == without.candidate.dp == 1 and with_sum.partition == without.partition
    busiest = max(with_sum.partition)
    assert with_sum.allreduce_time == pytest.approx(without.allreduce_time + 0.5 * busiest + 2.0)


def test_the_analytic_model_prices_the_second_sum_as_a_ring_over_the_tp_link():
    from pipeloom.tune.cost_model import AnalyticCostModel
    from pipeloom.tune.presets import load_hardware, load_model

    model, hardware = load_model("gpt3-13b"), load_hardware("a100-40g")
    summed = AnalyticCostModel(model, hardware, tp=8, sequence_parallel=True)
    assert AnalyticCostModel(model, hardware, tp=8).tp_sum_time(10, 1) == 0.0
    nbytes = 4 * (2 * 10 + 1) * model.hidden * 2 * 7 / 8  # a ring all-reduce moves 2(tp − 1)/tp of them
    link = summed.links()["tp"]
    assert summed.tp_sum_time(10, 1) == pytest.approx(1e3 * (nbytes / link.bandwidth + 14 * hardware.latency))


def test_a_lone_device_s_plan_folds_each_w_into_its_b_as_the_runtime_runs_it():
    """At pp = 1 nothing waits for a B, so the runtime runs each whole W inside it: a zero-bubble
    plan there is written and priced that way, no weight gradient held pending between B and W
    (which the profile's M_W would otherwise add to its peak)."""
    from pipeloom import OpKind, simulate

    data = profile()
    for size in ("1", "2"):
        plain(data)["fits"][size]["M_W"] = fit(500.0, 0.0, 0.0)
    model = ProfiledCostModel(data)
    for scheme in ("zb-v", "zb-h1"):
        best = tune(model, 2, 1e12, 8, schemes=[scheme], pp_values=[1], micro_batches=[1]).best
        kinds = {op.kind for ops in best.schedule.devices for op in ops}
        assert best.candidate.pp == 1 and OpKind.W not in kinds and OpKind.BW in kinds
        assert best.peak_memory == simulate(best.schedule, best.costs).peak_memory


def with_fused_backward(data: dict) -> dict:
    """`data` with a fused backward measured at each size: per layer 25 % below B + W, and its
    micro-batch's forward 20 % below F."""
    for size in ("1", "2"):
        fits = plain(data)["fits"][size]
        fits["BW"] = fit(1.125 * int(size), 0.375, 0.9)
        fits["F_BW"] = fit(0.8 * int(size), 0.4, 1.2)
    return data


def test_a_fused_backward_and_its_forward_are_priced_as_measured_wherever_the_runtime_fuses_them():
    """The runtime runs a W inside its B where nothing would fill the gap between them — every W
    at pp = 1, a W right after its B elsewhere — one autograd pass, its linears ordinary: the
    profile measures that pass (BW) and its micro-batch's forward (F_BW), and a plan that fuses
    is written folded and priced by them, an older profile's as B + W and F."""
    from pipeloom import OpKind, simulate

    model = ProfiledCostModel(with_fused_backward(profile()))
    costs = model.stage_costs([4, 4], 2, 2, 1)
    assert costs.BW == pytest.approx([4 * 2.25 + 0.375, 4 * 2.25 + 0.9])
    assert costs.F_BW == pytest.approx([4 * 1.6 + 0.4, 4 * 1.6 + 1.2])
    assert ProfiledCostModel(profile()).stage_costs([4, 4], 2, 2, 1).BW is None  # an older profile: B + W
    lone = tune(model, 2, 1e12, 8, schemes=["zb-h1"], pp_values=[1], micro_batches=[2]).best
    ops = [op for device in lone.schedule.devices for op in device]
    assert {op.kind for op in ops} == {OpKind.F, OpKind.BW}
    whole = lone.costs.resolve(1, 1)
    micro_batches = lone.schedule.num_microbatches  # a replica's
    assert lone.pipeline_time - lone.noise_time == pytest.approx(micro_batches * (whole.F_BW[0] + whole.BW[0]))
    # zb-h1 at pp = 2 runs its first device's W right after their B: folded, those micro-batches
    # are priced fused; the second device's, deferred, stay split
    pipelined = tune(model, 2, 1e12, 8, schemes=["zb-h1"], pp_values=[2], micro_batches=[2]).best
    kinds = [{op.kind for op in device} for device in pipelined.schedule.devices]
    assert kinds == [{OpKind.F, OpKind.BW}, {OpKind.F, OpKind.B, OpKind.W}]
    assert pipelined.pipeline_time - pipelined.noise_time == pytest.approx(
        simulate(pipelined.schedule, pipelined.costs).makespan
    )
    unfused = simulate(pipelined.schedule, dataclasses.replace(pipelined.costs, BW=None, F_BW=None)).makespan
    assert simulate(pipelined.schedule, pipelined.costs).makespan < unfused


def test_the_pruning_bounds_stay_below_every_plan_that_runs_a_fused_backward():
    """A fused micro-batch is cheaper than F, B and W apart: the bounds the tuner prunes on (the
    work floor, and the room floor of a schedule built with its W apart and folded after) never
    exceed the step of a plan that folds, unlimited or where memory binds."""
    from pipeloom.tune.search import _prepare, evaluate
    from pipeloom.tune.space import DEFAULT_SCHEMES, candidates

    model = ProfiledCostModel(with_fused_backward(profile()))
    checked = 0
    for memory in (1e12, 40_000.0):
        for candidate in candidates(4, 16, num_layers=8, schemes=list(DEFAULT_SCHEMES), micro_batches=[1, 2]):
            evaluation = evaluate(candidate, model, memory)
            if not evaluation.feasible:
                continue
            _, bound = _prepare(candidate, model, memory)
            assert bound <= evaluation.step_time * (1 + 1e-9), candidate.label
            checked += 1
    assert checked >= 20


def sharing_experts(data: dict) -> ProfiledCostModel:
    """The cost model of `data`'s mixture of experts with its experts shared out over ep = 2."""
    import dataclasses

    model = ProfiledCostModel(data)
    model.model = dataclasses.replace(model.model, expert_parallel=2)
    return model


def moe_profile() -> dict:
    """A mixture of experts (800 of a layer's 1000 parameters routed experts) with measured links,
    and its ops, stash and exchanges measured on replicas sharing out the experts (`ep2`)."""
    data = {**profile(), **links()}
    data["model"] = {**MODEL, "num_experts": 4, "num_experts_per_tok": 2}
    data["params"] = {**data["params"], "experts": 800}
    shared = {"F": 3.0, "B": 4.0, "W": 1.0, "R": 3.0, "M_B": 700.0, "M_ckpt": 40.0, "a2a_F": 0.5, "a2a_B": 0.25}
    data["layouts"]["ep2"] = {
        "fits": {
            size: {kind: {"per_layer": value * int(size), "single": 2 * value} for kind, value in shared.items()}
            for size in ("1", "2")
        }
    }
    return data


def test_an_expert_parallel_plan_is_priced_as_its_replicas_measured_it():
    """The ep = 2 probes ran one stage over two replicas sharing out its experts: with --ep 2 each
    op's compute, its stash and its all-to-alls in flight are theirs (slope, and the single
    stage's intercept, scaled at another position as the plain one is); without, the plain fits."""
    data = moe_profile()
    whole, shared = ProfiledCostModel(data), sharing_experts(data)
    plain, spread = whole.stage_costs([3, 5], 2, 2, 2), shared.stage_costs([3, 5], 2, 2, 2)
    assert plain.F == ProfiledCostModel(profile()).stage_costs([3, 5], 2, 2, 2).F and plain.a2a_F == 0.0
    # plain F intercepts at micro-batch 2: first 0.5, last 1.5, single 1.5 — measured single 6.0 scales them by 4
    assert spread.F == pytest.approx([3 * 6.0 + 2.0, 5 * 6.0 + 6.0])
    assert spread.M_B == pytest.approx([3 * 1400.0 + 1400.0 * 100 / 4000, 5 * 1400.0 + 1400.0])
    assert spread.a2a_F == pytest.approx([3 * 1.0 + 1.0, 5 * 1.0 + 1.0])  # no plain exchange: single everywhere
    assert spread.a2a_B == pytest.approx([3 * 0.5 + 0.5, 5 * 0.5 + 0.5])
    assert shared.extrapolations(2) == []
    two_steps = shared.a2a_step(build_schedule("1f1b", 2, 2), [3, 5], 2)  # each device: 2 F and 2 B
    assert two_steps == pytest.approx([2 * 4.0 + 2 * 2.0, 2 * 6.0 + 2 * 3.0])


def test_experts_shared_out_over_every_replica_sync_no_gradients():
    """At dp = EP each replica holds its own experts: only the rest of the stage is all-reduced
    (the runtime sums an expert's gradient over the replicas holding it, none here)."""
    data = moe_profile()
    shared = sharing_experts(data)
    assert shared.expert_params([3, 5]) == pytest.approx([3 * 400.0, 5 * 400.0])
    best = tune(shared, 2, 1e12, 8, schemes=["1f1b"], pp_values=[1], micro_batches=[2], static_measures=False).best
    dense = shared.stage_params([8])[0] - shared.expert_params([8])[0]  # 8 layers of 200 (+ both ends)
    assert best.allreduce_time == pytest.approx(shared.allreduce_time(dense, 1, 2))


def test_a_moe_block_is_held_whole_on_every_tp_rank_and_its_experts_shared_out_over_ep():
    """The runtime cuts the attention, embedding and head over tp and runs the MoE block (here 850
    of a layer's 1000: a router of 50 and 800 of routed experts) whole on every tp rank; ep shares
    the routed experts out. A profile without the block's count takes its experts for it."""
    data = moe_profile()
    data["params"]["moe_block"] = 850
    model = ProfiledCostModel(data, tp=2)
    model.model = dataclasses.replace(model.model, expert_parallel=2)
    cut = [(3 * 150 + 500) / 2, (5 * 150 + 600) / 2]
    assert model.stage_params([3, 5]) == pytest.approx([cut[0] + 3 * 450, cut[1] + 5 * 450])
    assert model.expert_params([3, 5]) == pytest.approx([3 * 400, 5 * 400])
    data["params"].pop("moe_block")
    older = ProfiledCostModel(data, tp=2)
    assert older.stage_params([3, 5]) == pytest.approx([(3 * 200 + 500) / 2 + 3 * 800, (5 * 200 + 600) / 2 + 5 * 800])


def test_replicas_wait_for_the_later_pipeline_as_measured_whatever_the_zero_level():
    """A profile that measured how far the later replica's pipeline ends past the two's mean
    prices that share of the pipeline — at every ZeRO level, under the plain and the shared-out
    experts' layouts alike."""
    data = moe_profile()
    wait = {"pipeline_ms": 80.0, "layers": 8, "skew_ms": 2.0, "overhead_ms": 3.0}
    data["layouts"]["plain"]["waits"] = {"0": wait}
    data["layouts"]["ep2"]["waits"] = {"0": {**wait, "skew_ms": 4.0}}
    dense, shared = ProfiledCostModel(data), sharing_experts(data)
    assert dense.replica_skew(2) == dense.replica_skew(2, zero=1) == dense.replica_skew(2, zero=2) == 0.025
    assert dense.replica_skew(8) == pytest.approx(0.025 * math.sqrt(3)) and dense.replica_skew(1) == 0.0
    assert shared.replica_skew(2) == pytest.approx(0.05)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: plain(p)["fits"]["1"]["F"].update(per_layer=float("nan")), r"fits\[1\]\.F\.per_layer is nan"),
        (
            lambda p: plain(p)["fits"]["2"]["B"].update(first=-1.25),
            r"fits\[2\]\.B\.first is -1.25: .* cannot be negative",
        ),
        (lambda p: plain(p)["fits"]["1"]["M_B"].update(last="4000"), r"fits\[1\]\.M_B\.last must be a number"),
        (lambda p: plain(p).update(fits={}), "`fits` must map micro-batch sizes"),
        (lambda p: plain(p).update(fits="1,2"), r"layouts\.plain\.fits must be a JSON object"),
        (lambda p: plain(p)["fits"].update({"0": plain(p)["fits"]["1"]}), "size '0', not a positive integer"),
        (lambda p: plain(p)["fits"]["1"].pop("W"), r"fits\[1\]\.W is missing"),
        (lambda p: p["links"]["p2p"].update(bytes_per_ms=0), r"links\.p2p\.bytes_per_ms is 0: it must be positive"),
        (lambda p: p["overheads"]["optimizer"].update(base_ms=-2.0), r"overheads\.optimizer\.base_ms is -2\.0"),
    ],
)
def test_a_profile_with_a_bad_number_is_refused_by_name(change, message):
    """A NaN per-layer time once became F = 0 in a plan (`max(0.0, nan)`), a negative one was
    accepted, a string or an empty `fits` gave a traceback: each is refused on load, naming it."""
    bad = profile()
    change(bad)
    with pytest.raises(ConfigError, match=message):
        ProfiledCostModel(bad)
    ProfiledCostModel(profile())  # the unchanged profile loads


def test_the_cli_refuses_a_bad_profile_in_one_line(tmp_path, capsys):
    import json

    from pipeloom.cli import main

    bad = profile()
    plain(bad)["fits"]["1"]["F"]["per_layer"] = float("nan")
    (tmp_path / "profile.json").write_text(json.dumps(bad))
    argv = ["tune", "--costs", str(tmp_path / "profile.json"), "--devices", "2", "--memory", "1GiB"]
    assert main(argv + ["--global-batch", "4", "--output", str(tmp_path / "plan.json")]) == 2
    err = capsys.readouterr().err
    assert "fits[1].F.per_layer is nan" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "plan.json").exists()


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "--tp 3: toy's 4 attention heads do not divide by 3"),  # before any warning of tp unmeasured
        (["--tp", "2", "--max-mbs", "0"], "--max-mbs must be at least 1, got 0"),
        (["--memory", "1KiB"], "no plan fits 1.00 KiB per device: the least any configuration needs is 7"),
    ],
)
def test_tune_on_a_profile_refuses_bad_flags_in_one_line(tmp_path, capsys, flags, message):
    import json

    from pipeloom.cli import main

    (tmp_path / "profile.json").write_text(json.dumps(profile()))
    argv = ["tune", "--costs", str(tmp_path / "profile.json"), "--devices", "2", "--global-batch", "4"]
    argv += ["--memory", "1GiB", *flags, "--output", str(tmp_path / "plan.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "plan.json").exists()


def test_tune_says_when_a_mixture_of_experts_was_profiled_on_other_tokens_than_its_plan():
    """A replica's stash follows what its experts are routed: a MoE profile of synthetic tokens (or
    another file) is named beside the plan's data; a dense model's, or the same file's, is not."""
    from pipeloom.cli.tune import routed_elsewhere
    from pipeloom.provenance import describe

    tokens = {"kind": "tokens", "path": "/data/train.bin", "dtype": "uint16", "bytes": 80000, "sha256": "ab"}
    moe, dense = ProfiledCostModel(moe_profile()), ProfiledCostModel(profile())
    note = routed_elsewhere(moe, tokens)
    assert note is not None and note.startswith("the profile's probes trained on synthetic tokens, the plan on token")
    assert "`profile --data /data/train.bin`" in note
    assert routed_elsewhere(dense, tokens) is None and routed_elsewhere(moe, None) is None
    same = ProfiledCostModel({**moe_profile(), "data": describe(tokens, brief=True)})
    assert routed_elsewhere(same, tokens) is None


def test_simulate_and_compare_price_a_profile_for_each_schedule_s_stages(tmp_path, capsys):
    """A profile's plain Costs keys price two stages; `simulate` and `compare` price it for the
    schedule's own (the 8 layers split evenly, the smallest profiled size, a device a rank), so a
    V of 4 stages on 2 devices runs on it too."""
    import json

    from pipeloom.cli import main
    from pipeloom.sim.simulate import simulate

    (tmp_path / "profile.json").write_text(json.dumps(profile()))
    costs = ["--costs", str(tmp_path / "profile.json"), "--json"]
    assert main(["simulate", "zb-v", "-p", "2", "-m", "4", *costs]) == 0
    summary = json.loads(capsys.readouterr().out)
    expected = ProfiledCostModel(profile()).stage_costs([2, 2, 2, 2], 1, 2, 1)
    assert summary["makespan"] == pytest.approx(
        simulate(build_schedule("zb-v", 2, 4, costs=expected), expected).makespan
    )
    assert main(["compare", "1f1b", "zb-v", "-p", "2", "-m", "4", *costs]) == 0
    assert [row["num_stages"] for row in json.loads(capsys.readouterr().out)] == [2, 4]
    assert main(["simulate", "1f1b", "-p", "16", "-m", "16", *costs]) == 2
    assert "the profiled model's 8 layers cannot fill 16 stages" in capsys.readouterr().err


def test_pareto_prices_a_profile_for_each_schedule_s_stages(tmp_path, capsys):
    """`pareto -p 4 --costs profile.json` left out every schedule (the file's plain keys price two
    stages): each is now priced for its own, 1F1B's 4 stages of 2 layers and ZB-V's 8 of 1, and
    zb-auto's budgets are spread over its 4 stages' own memory."""
    import json

    from pipeloom.cli import main
    from pipeloom.sim.simulate import simulate

    (tmp_path / "profile.json").write_text(json.dumps(profile()))
    argv = ["pareto", "-p", "4", "-m", "8", "--budgets", "3", "--costs", str(tmp_path / "profile.json"), "--json"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    points = {point["label"]: point for point in json.loads(out)}
    for name, counts in (("1f1b", [2] * 4), ("zb-v", [1] * 8)):
        costs = ProfiledCostModel(profile()).stage_costs(counts, 1, len(counts), 1)
        timeline = simulate(
            build_schedule(name, 4, 8, costs=costs) if name == "zb-v" else build_schedule(name, 4, 8), costs
        )
        assert points[name]["cost"] == pytest.approx(timeline.cost)
        assert points[name]["memory_unit"] == "bytes"
    from pipeloom.schedules.auto_search import min_memory_limits

    four = ProfiledCostModel(profile()).stage_costs([2] * 4, 1, 4, 1).resolve(4, 4)
    least = max(min_memory_limits([0, 1, 2, 3], four))  # zb-auto's least budget, on its own 4 stages
    assert sorted(float(label[8:]) for label in points if label.startswith("zb-auto@"))[0] == pytest.approx(
        least, rel=1e-3
    )
    assert sum(label.startswith("zb-auto@") for label in points) == 3 and "left out" not in err


def test_tune_says_when_the_ranks_would_share_the_profile_s_cores(tmp_path, capsys):
    """Its probes ran a rank a core: 4 ranks of 2 threads on the profile's 4 cores share them."""
    import json

    from pipeloom.cli import main

    data = profile()
    data["device"] = {"kind": "cpu", "description": "cpu, 2 thread(s) per rank, fp32", "threads": 2, "cores": 4}
    (tmp_path / "profile.json").write_text(json.dumps(data))
    argv = ["tune", "--costs", str(tmp_path / "profile.json"), "--memory", "1GiB", "--global-batch", "4", "--force"]
    for devices, note in [(2, None), (4, "4 ranks × 2 thread(s) on the profile's 4 cores: the ranks would share them")]:
        assert main([*argv, "--devices", str(devices), "--output", str(tmp_path / "plan.json")]) == 0
        out = capsys.readouterr().out
        assert (note in out and "up to 2× slower" in out) if note else "shared cores" not in out


@pytest.mark.parametrize(
    "device, contention",
    [("cuda, every stage in one process, fp32", None), ("cpu, 1 thread(s) per rank, fp32", None)]
    + [("cpu, 1 thread(s) per rank, fp32", 0.4)],
)
def test_chimera_s_copies_sum_their_gradients_and_only_its_dp_replicas_wait_for_each_other(device, contention):
    """Each stage's all-reduce starts after its last backward, under the device's later ops: the
    step pays what lies past the pipeline, and of what the pipeline hides the share its ops lose
    — none on a GPU, the links' measured share on CPU ranks (gloo sums on the cores the ops run
    on), all of it where the profile did not measure one. The two copies of a stage are in one
    pipeline, whose devices end where the timeline has them: only dp replicas, each a pipeline of
    its own, add the measured wait for the slowest."""
    from pipeloom.sim import exposed_sync
    from pipeloom.tune.search import tune

    data = {**profile(), **links(), "device": {"description": device}}
    data["device"]["kind"] = "cuda" if device.startswith("cuda") else "cpu"
    data["links"]["sync_contention"] = contention  # None: not measured
    data["layouts"]["plain"]["waits"] = {"0": {"pipeline_ms": 100.0, "layers": 4, "skew_ms": 12.0, "overhead_ms": 0.0}}
    model = ProfiledCostModel(data)
    share = 0.0 if device.startswith("cuda") else 1.0 if contention is None else contention
    assert model.sync_contention == share
    assert model.replica_skew(2) > 0.1 and model.replica_skew(4) > model.replica_skew(2)
    for devices, dp in ((2, 1), (4, 2)):
        best = tune(
            model, devices, 1e12, 8, schemes=["chimera"], pp_values=[2], micro_batches=[1], static_measures=False
        )
        best = best.best
        assert best.candidate.dp == dp
        params = model.stage_params(best.partition)  # each device holds a copy of every stage
        per_stage = [model.allreduce_time(count, 2, 2 * dp) for count in params]  # each after its last backward
        exposed = exposed_sync(best.timeline, per_stage)
        sequential = model.allreduce_time(sum(params), 2, 2 * dp)
        assert 0 < exposed < sequential  # some of it under the pipeline, never more
        paid = exposed + share * (sequential - exposed)
        wait = model.replica_skew(dp) * best.pipeline_time
        assert best.allreduce_time == pytest.approx(paid + wait)
        assert (wait > 0) == (dp > 1)


def test_the_bytes_a_b_leaves_for_its_w_are_priced_as_measured_and_none_from_an_older_profile():
    from pipeloom.tune.profiled import ProfiledCostModel

    older = ProfiledCostModel(profile()).stage_costs([2, 2], 2, pp=2, dp=1)
    assert tuple(older.M_W) == (0.0, 0.0)
    data = profile()
    for size in ("1", "2"):
        plain(data)["fits"][size]["M_W"] = fit(300.0 * int(size), 10.0, 20.0)
    costs = ProfiledCostModel(data).stage_costs([2, 2], 2, pp=2, dp=1)
    assert costs.M_W == pytest.approx([2 * 600.0 + 10.0, 2 * 600.0 + 20.0])  # per layer, plus each end's


def test_context_parallelism_is_priced_as_its_ranks_measured_it_or_estimated_and_marked():
    """Without a cp layout, a cp rank's ops are the plain ones at 1/cp of the micro-batch (its
    share of the tokens: as many FLOPs) plus the K/V all-gather on the measured link, and the plan
    is marked as beyond the profile; with `profile --cp` (one stage over cp ranks), as measured."""
    data = {**profile(), **links()}
    whole = ProfiledCostModel(data)
    estimated = ProfiledCostModel(data, cp=2)
    gathered = 2 * 4 * 2 * MODEL["seq_len"] * MODEL["hidden"]  # fp32 K and V of 2 whole sequences
    gather = 0.1 + gathered * 2 * (2 - 1) / 2 / 1e5  # the all-gather as its dp = 2 fit prices one
    half, two = whole.stage_costs([3, 3], 1, 2, 1), estimated.stage_costs([3, 3], 2, 2, 1)
    assert two.F == pytest.approx([f + 3 * gather for f in half.F])
    assert two.B == pytest.approx([b + 3 * gather for b in half.B]) and two.W == pytest.approx(half.W)
    assert two.M_B == pytest.approx(half.M_B)  # half the tokens each
    assert estimated.extrapolations(2) == ["cp 2 (never profiled: 1/2 of the tokens and the K/V exchange estimated)"]
    assert estimated.allreduce_time(1e6, 1, 1) == pytest.approx(whole.allreduce_time(1e6, 1, 2))
    measured = {kind: {"per_layer": 4.0 * k, "single": 3.0 * k} for k, kind in enumerate("FBWR", start=1)}
    data["layouts"]["cp2"] = {"fits": {"2": measured}, "layers": [1, 2, 3]}
    profiled = ProfiledCostModel(data, cp=2)
    assert profiled.stage_costs([3], 2, 1, 1).F == pytest.approx([3 * 4.0 + 3.0])  # the exchanges inside
    assert profiled.extrapolations(2, partition=[3]) == []
    assert [split.cp for split in profiled.measured_splits()] == [1, 2]
    # the K/V bytes a rank sends a step: each layer's keys and values in every F and B, (cp − 1)× its own
    schedule = build_schedule("1f1b", 1, 2)
    own = 2 * 4 * (2 / 2) * MODEL["seq_len"] * MODEL["hidden"]  # fp32 K and V of its half of 2 sequences
    assert profiled.kv_step(schedule, [3], 2) == pytest.approx([2 * 2 * 3 * own])


def test_a_tied_embedding_is_priced_once_on_a_device_hosting_both_ends():
    """Both ends' parameters count the tied weight; the costs say how much of their static bytes
    it is, and a V's first device, hosting both ends, holds it once."""
    from pipeloom.sim.simulate import simulate

    data = profile()
    data["params"]["tied"] = 300
    model = ProfiledCostModel(data)
    costs = model.stage_costs([2, 2, 2, 2], 1, 2, 1)
    assert costs.M_shared == 16 * 300  # fp32 weights and gradients, AdamW's two moments
    ends = simulate(build_schedule("zb-v", 2, 4), costs).static_memory[0]
    assert ends == pytest.approx(costs.stage_value("M_static", 0) + costs.stage_value("M_static", 3) - 16 * 300)
    assert ProfiledCostModel(profile()).stage_costs([2, 2, 2, 2], 1, 2, 1).M_shared == 0.0  # untied (or older)


def test_a_tied_embedding_is_stepped_and_synced_once_on_a_device_hosting_both_ends():
    """The tuner's optimizer step and gradient sync of a V's first device, hosting both ends,
    count the tied weight once, as the runtime holds it (one object); so do a single stage's."""
    data = profile()
    data["params"]["tied"] = data["params"]["first"]  # the head is the embedding
    data["overheads"]["optimizer"] = {"base_ms": 1.0, "per_param_ms": 1e-3}
    model = ProfiledCostModel(data)
    space = dict(schemes=["zb-v"], pp_values=[2], micro_batches=[1], layouts=False, static_measures=False)
    best = tune(model, 4, 1e12, 8, **space).best
    params = model.stage_params(best.partition)
    ends, middle = params[0] + params[3] - data["params"]["tied"], params[1] + params[2]
    assert ends < max(params[0] + params[3], middle)  # without the tie's once, the ends would be the busiest
    assert best.optimizer_time == pytest.approx(model.optimizer_time(max(ends, middle), 2))
    assert best.allreduce_time == pytest.approx(model.allreduce_time(max(ends, middle), 2, 2))  # no replicas' wait
    single = tune(model, 2, 1e12, 8, **{**space, "schemes": ["1f1b"], "pp_values": [1]}).best  # one stage: both ends
    whole = model.stage_params(single.partition)[0] - data["params"]["tied"]
    assert single.optimizer_time == pytest.approx(model.optimizer_time(whole, 2))
    assert single.static_memory[0] == pytest.approx(single.costs.stage_value("M_static", 0) - single.costs.M_shared)


def test_a_step_zeroes_the_gradient_buffers_its_replicas_sum_in_place():
    """The rest of a step grows with the parameters whose gradients a device's buffers hold for
    its replicas — dp replicas, Chimera's copies, cp ranks holding the same weights — and not at
    all without replicas; a tied embedding on a device hosting both ends is one buffer."""
    data = profile()
    data["params"]["tied"] = data["params"]["first"]
    data["overheads"] = {
        "optimizer": {"base_ms": 1.0, "per_param_ms": 0.0},
        "step": {"base_ms": 2.0, "per_param_ms": 1e-3},
    }
    model = ProfiledCostModel(data)
    whole = 8 * 1000.0 + 600  # every layer, the head, and the embedding tied to it
    space = dict(micro_batches=[1], layouts=False, static_measures=False)
    assert tune(model, 2, 1e12, 8, schemes=["1f1b"], pp_values=[1], **space).best.overhead_time == 2.0 + whole * 1e-3
    assert tune(model, 2, 1e12, 8, schemes=["1f1b"], pp_values=[2], **space).best.overhead_time == 2.0
    chimera = tune(model, 2, 1e12, 8, schemes=["chimera"], pp_values=[2], **space).best
    assert chimera.candidate.dp == 1 and chimera.overhead_time == pytest.approx(2.0 + whole * 1e-3)
    assert chimera.step_time == pytest.approx(
        chimera.pipeline_time + chimera.allreduce_time + chimera.optimizer_time + chimera.overhead_time
    )
    context = tune(ProfiledCostModel({**data, **links()}, cp=2), 2, 1e12, 8, schemes=["1f1b"], pp_values=[1], **space)
    assert context.best.candidate.dp == 1 and context.best.overhead_time == 2.0 + whole * 1e-3  # cp ranks sum too
