"""The typed profile (`pipeloom.profile/2`): what is written is what is read, and a bad entry is
named by its place in the file."""

import json
import math

import pytest

from pipeloom import ConfigError
from pipeloom.profile_format import (
    PROFILE_FORMAT,
    Fit,
    Layout,
    Profile,
    ReplicaWait,
)
from pipeloom.tune.profiled import ProfiledCostModel

from .test_profiled import MODEL, fit, links, profile

STEADY = [0.9 + 0.01 * k for k in range(21)]


def every_part() -> dict:
    """A profile with every part: fits with M_W, links, overheads, speeds, confidence, a
    tensor-parallel layout, an expert-parallel one and the replicas' waits."""
    data = profile() | links()
    plain = data["layouts"]["plain"]
    for size in ("1", "2"):
        plain["fits"][size]["M_W"] = fit(300.0 * int(size), 10.0, 20.0)
    single = {"per_layer": 2.0, "single": 1.0}
    wait = {"pipeline_ms": 90.0, "skew_ms": 2.0, "overhead_ms": 1.0}
    plain |= {
        "speed": {"step": STEADY, "op": STEADY, "op_mean": 1.01},
        "confidence": {"1": {"F": 0.01, "B": 0.02}, "2": {"F": 0.03}},
    }
    plain["waits"] = {"0": {"pipeline_ms": 50.0, "layers": 2, "skew_ms": 1.5, "overhead_ms": 3.0}}
    data["links"]["sync_contention"] = 0.6
    data["layouts"] |= {
        "tp2": {
            "fits": {size: {kind: single for kind in ("F", "B", "W", "R")} for size in ("1", "2")},
            "speed": {"step": STEADY, "op": STEADY},
        },
        "ep2": {
            "fits": {size: {kind: single for kind in ("F", "B", "W", "R", "a2a_F", "a2a_B")} for size in ("1", "2")},
            "waits": {"0": {**wait, "layers": 3}},
        },
    }
    return data | {
        "model": MODEL | {"num_experts": 4, "num_experts_per_tok": 2},
        "params": {"layer": 1000, "first": 500, "last": 600, "experts": 400},
        "noise": {"median_spread": 0.02, "worst_spread": 0.05, "rounds": 8, "probes": 4},
        "device": {"kind": "cpu", "description": "cpu, 1 thread(s) per rank, fp32", "threads": 1},
        "source": "hf:./my-model",
    }


def test_a_profile_reads_back_what_it_wrote_through_json():
    import dataclasses

    typed = Profile.from_dict(every_part())
    typed = dataclasses.replace(
        typed, layouts={**typed.layouts, Layout(): dataclasses.replace(typed.plain, layers=(1, 2))}
    )
    written = json.loads(json.dumps(typed.to_dict()))
    assert written["format"] == PROFILE_FORMAT and set(written["layouts"]) == {"plain", "tp2", "ep2"}
    assert written["layouts"]["plain"]["layers"] == [1, 2] and written["layouts"]["tp2"]["layers"] == []
    assert Profile.from_dict(written) == typed


def test_a_profile_s_parts_are_typed_and_keyed_by_layout():
    typed = Profile.from_dict(every_part())
    assert set(typed.layouts) == {Layout(), Layout(tp=2), Layout(ep=2)}
    assert typed.plain.fits[2]["F"] == Fit(2.0, 1.5, first=0.5, last=1.5, middle=0.5)
    assert typed.plain.fits[1]["M_W"].per_layer == 300.0 and typed.plain.confidence[2] == {"F": 0.03}
    assert typed.plain.speed.step == tuple(STEADY) and typed.plain.speed.op_mean == 1.01
    assert typed.layout(Layout(tp=2)).fits[1]["F"] == Fit(2.0, 1.0)  # one stage: its single intercept
    assert typed.expert_parallel is not None and typed.expert_parallel[0] == 2
    assert typed.expert_parallel[1].fits[2]["a2a_B"] == Fit(2.0, 1.0)
    assert typed.expert_parallel[1].waits == {0: ReplicaWait(90.0, 3, skew_ms=2.0, overhead_ms=1.0)}
    assert typed.plain.waits == {0: ReplicaWait(50.0, 2, skew_ms=1.5, overhead_ms=3.0)}
    assert typed.links.dp == 2 and typed.links.sync_contention == 0.6
    assert typed.params.experts == 400 and typed.source == "hf:./my-model" and typed.noise.rounds == 8
    assert typed.device.threads == 1 and typed.noise.wall_over_cpu is None


def test_an_expert_parallel_group_the_profile_never_ran_is_marked():
    """The profile's experts were shared out over two replicas: ep 2 is priced as measured, ep 4
    from those exchanges, and a profile without them prices no all-to-all at all."""
    import dataclasses

    measured = ProfiledCostModel(every_part())
    for ep, reasons in ((1, []), (2, []), (4, ["ep 4 (profiled: ep 2)"])):
        measured.model = dataclasses.replace(measured.model, expert_parallel=ep)
        assert measured.extrapolations(1) == reasons
    data = every_part()
    del data["layouts"]["ep2"]
    unmeasured = ProfiledCostModel(data)
    unmeasured.model = dataclasses.replace(unmeasured.model, expert_parallel=2)
    assert unmeasured.extrapolations(1) == ["ep 2 (never profiled: no all-to-all priced)"]


def test_layout_keys_name_every_layout_and_refuse_others():
    every = (Layout(), Layout(2), Layout(4, True), Layout(ep=2), Layout(2, ep=4), Layout(slices=4), Layout(cp=2))
    for layout in every:
        assert Layout.from_key(layout.key) == layout
    assert [Layout(2, True).key, Layout(ep=2).key, Layout(slices=2).key] == ["tp2+sp", "ep2", "s2"]
    assert Layout(cp=2).key == "cp2" and Layout(cp=2).stages == 1
    for bad in ("tp", "tpx", "dp2", "tp1", "", "s1", "cp1", "tp2,tp2", "s2,tp2", "ep2+sp", "cp2+sp"):
        with pytest.raises(ConfigError, match="not plain or tpN"):
            Layout.from_key(bad)


@pytest.mark.parametrize(
    "change, message",
    [
        (
            lambda p: p["layouts"]["plain"]["fits"]["1"]["F"].update(per_layer=math.nan),
            r"layouts\.plain\.fits\[1\]\.F\.per_layer is nan",
        ),
        (
            lambda p: p["layouts"]["tp2"]["fits"]["2"]["B"].update(single=-1.0),
            r"layouts\.tp2\.fits\[2\]\.B\.single is -1\.0: .* cannot be negative",
        ),
        (lambda p: p["layouts"]["plain"]["fits"]["1"].update(Q={}), r"layouts\.plain\.fits\[1\] has \['Q'\]"),
        (
            lambda p: p["layouts"]["ep2"]["fits"]["1"]["a2a_F"].update(per_layer="0.1"),
            r"layouts\.ep2\.fits\[1\]\.a2a_F\.per_layer must be a number",
        ),
        (
            lambda p: p["layouts"]["plain"]["speed"].update(step=[1.0, 0.0]),
            r"layouts\.plain\.speed\.step is 0\.0: it must be positive",
        ),
        (lambda p: p["links"]["allreduce"].update(bytes_per_ms=0), r"links\.allreduce\.bytes_per_ms is 0"),
        (lambda p: p["layouts"]["plain"]["waits"].update({"x": {}}), r"layouts\.plain\.waits has a ZeRO level 'x'"),
        (
            lambda p: p["layouts"]["plain"]["waits"]["0"].update(pipeline_ms=0.0),
            r"layouts\.plain\.waits\[0\]\.pipeline_ms is 0\.0: it must be positive",
        ),
        (lambda p: p["layouts"].pop("plain"), "layouts has no 'plain'"),
        (lambda p: p["layouts"].update(dp2={}), r"layout 'dp2', not plain or tpN\[\+sp\], epN, sN, cpN"),
        (lambda p: p.pop("links"), "it has no 'links'"),
        (lambda p: p["layouts"]["plain"].update(layers=[0, 2]), r"layouts\.plain\.layers is 0: it must be positive"),
        (lambda p: p["layouts"]["plain"].update(layers="1,2"), r"layouts\.plain\.layers must be a list"),
        (lambda p: p["noise"].update(busy_allowed="yes"), r"noise\.busy_allowed must be true or false"),
        (lambda p: p["links"]["p2p"].pop("latency_ms"), r"links\.p2p\.latency_ms is missing"),
        (lambda p: p["layouts"]["ep2"]["waits"]["0"].update(layers=1.5), r"layers is 1\.5, not a whole number"),
        # what an earlier pipeloom did not measure is refused, not guessed at from a residual
        (
            lambda p: p["layouts"]["plain"]["waits"]["0"].pop("skew_ms"),
            r"waits\[0\]\.skew_ms is missing; profile again",
        ),
        (lambda p: p["links"].pop("reduce_scatter"), r"links\.reduce_scatter is missing"),
        (lambda p: p["layouts"]["plain"]["fits"]["2"].pop("M_W"), r"fits\[2\]\.M_W is missing"),
        (lambda p: p["overheads"].pop("optimizer"), r"overheads\.optimizer is missing"),
    ],
)
def test_a_bad_entry_of_a_format_2_profile_is_named_by_its_place(change, message):
    data = json.loads(json.dumps(Profile.from_dict(every_part()).to_dict()))
    change(data)
    with pytest.raises(ConfigError, match=message):
        Profile.from_dict(data)
