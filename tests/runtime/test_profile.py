"""The profiler's output round-trips into simulate and tune; a tuned plan round-trips into train."""

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("torch")

from types import SimpleNamespace  # noqa: E402

from pipeloom.cli import main  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.profile.layouts import replica_wait  # noqa: E402
from pipeloom.profile.probe_rounds import steady_records  # noqa: E402
from pipeloom.profile_format import Layout, Profile  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = {
    "name": "nano",
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 64,
    "max_position_embeddings": 16,
    "hidden_act": "silu",
}


def test_profile_simulate_tune_train(tmp_path, capsys):
    model = tmp_path / "nano.json"
    model.write_text(json.dumps(MODEL))
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    assert (
        main(
            [
                "profile",
                "--model",
                str(model),
                "--mbs",
                "1,2",
                "--layers",
                "1,2",
                "--steps",
                "1",
                "--max-rounds",
                "2",  # a quick profile: what is checked here is the flow, not the figures' settling
                "--output",
                str(profile),
            ]
        )
        == 0
    )
    data = json.loads(profile.read_text())
    assert data["format"] == "pipeloom.profile/2" and data["model"]["hidden"] == 32
    typed = Profile.from_dict(data)  # what `tune` reads is what `profile` wrote
    assert Profile.from_dict(typed.to_dict()) == typed and typed.device.kind == "cpu"
    assert typed.device.cores == len(os.sched_getaffinity(0)) and typed.device.threads == 1
    # what the runtime adds beyond the ops, and how noisy the machine was, are in the profile
    overheads = typed.overheads
    assert overheads.op_ms >= 0 and overheads.step.base_ms >= 0
    assert overheads.optimizer is not None and overheads.optimizer.ms(1) > 0
    for link in (typed.links.p2p, typed.links.allreduce):
        assert link is not None and link.latency_ms >= 0 and link.bytes_per_ms > 0
    assert typed.noise.probes == 4 and typed.noise.rounds >= 2 * 4 and 0 <= typed.noise.median_spread
    fits = typed.plain.fits
    assert sorted(fits) == [1, 2] and list(typed.layouts) == [Layout()]
    assert typed.plain.layers == (1, 2)  # what a plan's stages may hold before it is marked as extrapolated
    for size in (1, 2):
        # a layer's time may fit as 0 when the machine's jitter swamps it (a busy machine), never below
        assert fits[size]["F"].per_layer >= 0 and fits[size]["F"].at("first") + fits[size]["F"].per_layer > 0
        assert fits[size]["M_B"].per_layer > 0 and fits[size]["M_W"].per_layer > 0  # a B leaves its W bytes
        assert None not in (fits[size]["F"].first, fits[size]["F"].last, fits[size]["F"].middle)
    # activations grow with the micro-batch (the rotary tables do not: nearly, not exactly, twice)
    assert fits[2]["M_B"].per_layer == pytest.approx(2 * fits[1]["M_B"].per_layer, rel=0.05)

    assert main(["simulate", "1f1b", "-p", "2", "-m", "4", "--costs", str(profile), "--json"]) == 0
    simulated = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert simulated["makespan"] > 0 and simulated["peak_activation_memory"][0] > 0

    assert (
        main(
            [
                "tune",
                "--costs",
                str(profile),
                "--devices",
                "2",
                "--memory",
                "1GiB",
                "--global-batch",
                "4",
                "--schemes",
                "1f1b,zb-h1,chimera,zb-auto",  # two stages: the positions the profile measured
                "--max-mbs",
                "2",
                "--pp",
                "2",
                "--output",
                str(plan),
                "--explain",
            ]
        )
        == 0
    )
    ranking = capsys.readouterr().out
    static = next(line for line in ranking.splitlines() if line.startswith("static memory:"))
    assert " KiB per device at most (ZeRO-0), within 1.00 GiB" in static  # a small model: not "0.00 GiB"
    assert "max MiB  min MiB  host MiB" in ranking  # nor a column of them
    assert main(["train", "--plan", str(plan), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "fidelity" in out and "step time" in out
    step_line = next(line for line in out.splitlines() if line.strip().startswith("step time"))
    assert "1 timed step: no noise to compare; run --steps 7 or more" in step_line  # 2 steps: 1 after the warm-up
    for phase in ("pipeline", "allreduce", "optimizer", "overhead"):  # the breakdown, predicted vs measured
        assert any(line.strip().startswith(phase) and " ms  vs " in line for line in out.splitlines())
    why = next(line for line in out.splitlines() if line.strip().startswith("why:"))  # the run's ops replayed
    assert "of the step (the run's own ops replayed: " in why and "runtime " in why
    saved = json.loads(plan.read_text())
    for device in range(saved["pp"]):  # the stash the runtime measured is what the plan predicted
        line = next(line for line in out.splitlines() if line.strip().startswith(f"device {device} activations"))
        assert "(+0.0%)" in line or "(-0.0%)" in line

    saved_mbs = saved["micro_batch_size"]
    for flag, value, message in (  # the plan fixes the shape it was priced at: another is refused
        ("--seq-len", 8, "--plan fixes the sequence length = 16: drop --seq-len 8"),
        ("--seq-len", 32, "--plan fixes the sequence length = 16: drop --seq-len 32"),  # the flag's default, given
        ("--microbatch-size", saved_mbs + 1, f"--plan fixes the micro-batch size = {saved_mbs}"),
        ("--ep", 2, "--plan fixes ep = 1: drop --ep 2"),  # it had run, priced as the plan without
        ("--dp", 2, "--plan fixes dp = 1: drop --dp 2"),
    ):
        assert main(["train", "--plan", str(plan), flag, str(value)]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "--plan", str(plan), "--steps", "1", "--dtype", "bf16", "--zero", "1"]) == 0  # says so
    out = capsys.readouterr().out
    assert "dtype: --dtype bf16 replaces the plan's fp32, and the plan's prediction is of fp32" in out
    assert f"zero: --zero 1 replaces the plan's ZeRO-{saved['zero']}, and the plan's prediction is of ZeRO-" in out
    assert saved["inputs"]["device"] == "cpu" and saved["inputs"]["threads"] == 1  # the profile's: what it priced
    # a plan of ZeRO-1 measured on 2 threads a rank of a GPU: --zero 0 and --threads 1, the flags' defaults, given
    elsewhere = tmp_path / "elsewhere-plan.json"
    elsewhere.write_text(
        json.dumps({**saved, "zero": 1, "inputs": {**saved["inputs"], "threads": 2, "device": "cuda"}})
    )
    from pipeloom.runtime import spec_from_plan as runtime_spec

    assert runtime_spec(elsewhere).threads == 2  # run as measured unless told otherwise
    assert main(["train", "--plan", str(elsewhere), "--steps", "1", "--zero", "0", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "zero: --zero 0 replaces the plan's ZeRO-1" in out
    assert "threads: --threads 1 replaces the plan's 2 thread(s) a rank" in out
    assert "device: this run is on cpu, and the plan's prediction is of cuda (its profile's device)" in out

    # The same plan from Python, through the runtime's public surface only.
    from pipeloom.runtime import reference_training, run_in_process, spec_from_plan

    spec = spec_from_plan(plan, steps=2)
    assert spec.schedule.to_text() == saved_schedule_text(plan) and spec.dp == saved["dp"]
    results = run_in_process(spec)
    losses, _ = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    with pytest.raises(ConfigError, match="the plan fixes dp"):
        spec_from_plan(plan, dp=3)
    with pytest.raises(ConfigError, match="unknown option"):
        spec_from_plan(plan, stepz=3)


def saved_schedule_text(plan_path) -> str:
    from pipeloom.tune.plan import Plan

    return Plan.load(str(plan_path)).schedule.to_text()


def test_the_replicas_wait_is_measured_over_steady_steps_after_the_warm_up():
    """Rank 0 waits 4 ms in one steady step (at the gradient sync) and 2 ms in another of five (at
    the loss's all-reduce, in the rest of the step, 1 ms otherwise); the later replica's pipeline
    ends 3, 0, 5, 1 and 2 ms past the two's mean; the warm-up steps and a step in which rank 1
    ran in a slow spell (its pipeline 100 ms longer) count for nothing."""

    def result(busy_ms, waits_ms, rest_ms=(0,) * 5, pipelines_ms=(100,) * 5):
        records = [SimpleNamespace(ops=[("0F0", 0.0, b / 1e3)]) for b in busy_ms]
        phases = [
            {"pipeline": p / 1e3, "allreduce": (10.0 + w) / 1e3, "optimizer": 0.005, "overhead": (1.0 + r) / 1e3}
            for w, r, p in zip(waits_ms, rest_ms, pipelines_ms)
        ]
        return SimpleNamespace(records=records, phase_seconds=phases)

    rounds = [
        [
            result([120, 110, 100, 100, 100], [30, 30, 4, 0, 60]),
            result([120, 110, 100, 101, 200], [0] * 5, pipelines_ms=(150, 150, 106, 100, 200)),
        ],
        [
            result([120, 110, 100, 100, 100], [30, 30, 0, 0, 0], (0, 0, 2, 0, 0)),
            result([120, 110, 100, 100, 100], [0] * 5, pipelines_ms=(150, 150, 90, 98, 104)),
        ],
    ]
    wait = replica_wait(rounds, steady_records(rounds)[0], 2)
    assert wait.pipeline_ms == pytest.approx(100.0)
    assert wait.skew_ms == pytest.approx(2.0) and wait.layers == 2  # the median of 3, 0, 5, 1, 2
    assert wait.overhead_ms == pytest.approx(1.0)  # rank 0's: the median of 1, 1, 3, 1, 1


def test_a_one_stage_layout_fits_its_sync_phase_beside_its_ops():
    """A probe of one stage over tp ranks sums what its ranks hold whole after the pipeline
    (sequence parallelism's second sum): its sync phase is fitted over the layers as "sync",
    beside rank 0's ops, and its stash as its fullest peer holds it (experts shared out hold
    what is routed to them); a two-stage layout's (no replicas) is not."""
    from pipeloom.profile.layouts import fits
    from pipeloom.profile.probe_rounds import Probe
    from pipeloom.profile.steadiness import Measured
    from pipeloom.profile_format import Fit
    from pipeloom.tune.profile_fits import fit_positions

    def probe(layers: int) -> Probe:
        values = {"F@0": 2.0 * layers + 1.0, "F@1": 9.0, "allreduce": 0.5 * layers + 2.0}
        values |= {"M_B@0": 100.0 * layers, "M_B@1": 120.0 * layers + 10}  # its peer routed more tokens
        return Probe(None, {key: Measured(value, 0.0, 8, 2, True) for key, value in values.items()}, [], 1.0)

    measured = {(1, n): probe(n) for n in (1, 2, 4)}
    one = fits(measured, [1], stages=1)[1]
    assert set(one) == {"F", "M_B", "sync"}
    assert (one["sync"].per_layer, one["sync"].single) == pytest.approx((0.5, 2.0))
    assert (one["F"].per_layer, one["F"].single) == pytest.approx((2.0, 1.0))  # rank 0's time
    assert (one["M_B"].per_layer, one["M_B"].single) == pytest.approx((120.0, 10.0))  # the fuller peer's bytes
    two = fits(measured, [1], stages=2)[1]  # two stages: rank 1 is the last stage, no peer
    each = [("first", n, 100.0 * n) for n in (1, 2, 4)] + [("last", n, 120.0 * n + 10) for n in (1, 2, 4)]
    assert "sync" not in two and two["M_B"] == Fit(**fit_positions(each))


def test_a_sliced_probe_trains_as_the_whole_one_and_its_slices_pool_into_the_fits():
    """`profile --slices 2`: the probe schedule with each micro-batch in two causal slices (a
    micro-batch's F slice by slice, its R, B and W from the last slice back) computes what the
    whole probe does — the same losses and weights, in one process — and its samples hold every
    slice's ops under their kind, as the fits read them."""
    from dataclasses import replace

    import torch

    from pipeloom.profile.probe_rounds import ProbeModel, probe_schedule, samples
    from pipeloom.runtime.in_process import run_in_process
    from pipeloom.tune.presets import model_from_config

    sliced = probe_schedule(2, slices=2)
    sliced.validate()
    assert sliced.num_slices == 2 and [op.text for op in sliced.devices[1][:8]] == [
        *("1F0", "1F0.1", "1B0.1", "1W0.1", "1B0", "1W0", "1F1", "1F1.1"),
    ]
    model = model_from_config(MODEL)
    whole, halves = (
        run_in_process(replace(ProbeModel(model, steps=2).spec(2, 1, slices=s), record_gradients=True)) for s in (1, 2)
    )
    assert halves[0].losses == pytest.approx(whole[0].losses, rel=1e-5)
    assert all(result.gradients for result in whole)
    for a, b in zip(whole, halves):
        for stage, gradients in a.gradients.items():
            for name, value in gradients.items():
                torch.testing.assert_close(b.gradients[stage][name], value, rtol=1e-4, atol=1e-6)
                torch.testing.assert_close(b.parameters[stage][name], a.parameters[stage][name], rtol=1e-5, atol=1e-6)
    taken = samples(halves)
    timed_steps, plain_fs, slices = 2, 3, 2  # 2 timed after 2 of warm-up; the checkpointed Fs are not sampled
    sampled_fs = plain_fs * slices - 1  # nor each step's first op
    assert len(taken["F@0"]) == timed_steps * sampled_fs and len(taken["R@1"]) == timed_steps * 1 * slices
    assert len(taken["M_B@0"]) == plain_fs * slices and len(taken["M_ckpt@0"]) == slices and min(taken["M_W@1"]) > 0
    # one micro-batch's backward fused, one autograd pass: it and its forward timed as their own kinds
    assert len(taken["BW@1"]) == len(taken["F_BW@1"]) == timed_steps * slices


def test_a_profile_taken_in_one_process_forks_no_rank_and_prices_its_ops_one_after_another(monkeypatch):
    """What `profile --device cuda` does on its one GPU, here on the CPU: every stage of each probe
    in this process (no rank forked, no link between ranks), the links those of one process, the
    replicas' wait none, and the per-op overhead fitted against the ops run one after another."""
    from pipeloom.profile import profiler
    from pipeloom.profile.profiler import profile_model
    from pipeloom.runtime import local
    from pipeloom.tune.presets import model_from_config
    from pipeloom.tune.profiled import ProfiledCostModel

    def no_fork(*args, **kwargs):
        raise AssertionError("a rank was forked")

    monkeypatch.setattr(local, "run_local", no_fork)
    monkeypatch.setattr(profiler, "measure_links", no_fork)
    profile = profile_model(
        model_from_config(MODEL), (1,), (1, 2), steps=1, max_rounds=2, in_process=True, allow_busy=True
    )
    assert profile.device.kind == "cpu" and "one process" in profile.device.description
    assert profile.plain.waits == {} and list(profile.layouts) == [Layout()]
    assert Profile.from_dict(profile.to_dict()) == profile
    fits = profile.plain.fits[1]
    assert fits["F"].per_layer + fits["F"].at("first") > 0 and fits["M_B"].per_layer > 0
    cost_model = ProfiledCostModel(profile)
    assert cost_model.stage_costs([1, 1], 1, 2, 1).comm == profile.links.p2p.ms(4 * 1 * 16 * 32)  # one activation
    assert profile.links.allreduce == profile.links.reduce_scatter  # the replicas' sum: an add


def test_the_overhead_of_ops_run_one_after_another_is_what_their_sum_leaves_over():
    from pipeloom.costs import Costs
    from pipeloom.profile.overheads import serial_op_overhead_ms
    from pipeloom.profile.probe_rounds import probe_schedule

    schedule = probe_schedule(2)  # per device 5 F (1 checkpointed, 1 of a fused backward), 1 R, 4 B, 4 W, 1 BW
    costs = Costs(F=2.0, B=3.0, W=1.0, R=2.0, BW=3.5, F_BW=1.5, comm=5.0)
    serial = 2 * (4 * 2.0 + 1.5 + 1 * 2.0 + 4 * 3.0 + 4 * 1.0 + 3.5)  # in one process no message waits: no comm
    assert schedule.num_ops == 30
    assert serial_op_overhead_ms(schedule, costs, serial + 0.25 * 30) == pytest.approx(0.25)


def test_the_profile_counts_a_tied_embedding_as_both_ends_shared():
    """A Hugging Face LLaMA with tied embeddings: its head is its embedding, counted by both ends."""
    from pipeloom.models.hf import hf_workload
    from pipeloom.profile.profiler import _params
    from pipeloom.tune.presets import model_from_config

    directory = Path(__file__).resolve().parents[2] / "examples" / "hf-llama-tiny"
    work = hf_workload(directory, microbatch_size=1, seq_len=16)
    params = _params(model_from_config(json.loads((directory / "config.json").read_text())), lambda n, mbs: work)
    assert params.tied == 2048 * 128 and params.first >= params.tied and params.last >= params.tied


def test_the_rest_of_a_step_is_fitted_per_parameter_its_replicas_zero():
    """The plain probes hold no gradient buffers (no replicas): their rest of a step is the base.
    The replicas' probe zeroes one buffer for its single stage's parameters (a tied embedding
    once): its excess over the base, per parameter, is the slope; never below zero."""
    from pipeloom.profile.profiler import step_overhead
    from pipeloom.profile_format import LinearCost, ReplicaWait

    model = SimpleNamespace(stage_params=lambda counts: [counts[0] * 1000.0 + 500 + 600], tied_params=lambda: 500.0)
    wait = ReplicaWait(pipeline_ms=100.0, layers=2, skew_ms=1.0, overhead_ms=4.1)
    assert step_overhead(2.0, wait, model) == LinearCost(2.0, pytest.approx(2.1 / 2600))
    assert step_overhead(2.0, None, model) == LinearCost(2.0)  # in one process: no replicas
    assert step_overhead(5.0, wait, model) == LinearCost(5.0, 0.0)


def test_probes_of_more_ranks_than_cores_are_named():
    """Two stages of one thread each fit two cores; a stage over 4 tp ranks, or two threads a rank, do not."""
    from pipeloom.profile.profiler import crowded_probes

    layouts = [Layout(), Layout(tp=4), Layout(cp=2), Layout(ep=2)]
    assert crowded_probes([Layout(), Layout(cp=2), Layout(ep=2)], threads=1, cores=2) is None
    assert "the probes of tp4 (4 ranks) ran 1 thread(s) a rank on 2 cores" in crowded_probes(layouts, 1, 2)
    assert "plain (2 ranks), tp4 (4 ranks), cp2 (2 ranks), ep2 (2 ranks) ran 2" in crowded_probes(layouts, 2, 2)
    assert crowded_probes(layouts, threads=2, cores=8) is None
