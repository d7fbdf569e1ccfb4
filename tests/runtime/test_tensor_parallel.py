"""Tensor and sequence parallelism inside a stage: pp × tp (× dp) gloo ranks train Hugging Face
models on a token file like one process.

These fork ranks: DTensor's collectives need a process group per rank, so tensor parallelism has
no in-process tier. Each run is one small model, two steps.

Tolerances follow from the arithmetic. A row-parallel linear sums its partial products in another
order than one process, so gradients agree to fp32 rounding of their terms (checked relative to
each tensor's scale). AdamW's first steps divide each gradient by its own size (+1e-8), which
turns a rounding difference δ in a near-zero gradient into a weight difference of up to lr·δ/1e-8;
with δ ≈ 1e-10 here the runs use lr = 1e-5 so that this stays under the 1e-6 of atol, and every
parameter is then compared at rtol 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY, with_layers  # noqa: E402
from helpers.runtime import (  # noqa: E402
    assert_gradients_close,
    assert_matches_reference,
)

from pipeloom import build_schedule  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.layout import RankLayout  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

LR = 1e-5
SEQ = 16
LLAMA = TINY["llama"]  # grouped-query attention, tied embeddings
OTHERS = {family: TINY[family] for family in ("qwen2", "gpt2", "bert")}
"""Qwen2: biased q, k, v (column-parallel biases); GPT-2: one fused Conv1D for q, k, v, tied
embeddings; BERT: bidirectional, its embeddings' norm on the whole sequence before it is cut."""
SCHEDULES = {"1f1b": {}, "zb-h1": {}, "interleaved": {"num_chunks": 2}, "zb-v": {}}


def model_dir(tmp_path, config: dict, layers: int = 2):
    """The model, a layer a stage (each layer's collectives are most of a forked rank's time)."""
    directory = tmp_path / f"{config['model_type']}-{layers}"
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(with_layers(config, layers)))
    return directory


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    from pipeloom.data import write_token_file

    ids = torch.randint(0, 96, (4000,), generator=torch.Generator().manual_seed(5))
    return write_token_file(tmp_path_factory.mktemp("tokens") / "tokens.bin", ids.numpy(), "uint16")


def llama_spec(tmp_path, token_file, schedule: str, lr: float = LR, **changes) -> TrainSpec:
    from pipeloom.data import TokenFile

    built = build_schedule(schedule, 2, 2, **SCHEDULES.get(schedule, {}))
    directory = model_dir(tmp_path, LLAMA, max(2, built.num_stages))
    work = hf_workload(directory, seed=1, microbatch_size=2, seq_len=SEQ, data=TokenFile(token_file, SEQ, seed=2))
    return TrainSpec(built, workload=work, lr=lr, **changes)


def assert_trains_like_one_process(spec: TrainSpec, results) -> None:
    """Losses and every gathered parameter as one process; the last step's gradients to rounding."""
    expected_gradients: list = []
    losses, expected = reference_training(spec, expected_gradients)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    for result in results:
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                torch.testing.assert_close(value, expected[stage][name], rtol=1e-5, atol=1e-6, msg=name)
    assert_gradients_close(results, expected_gradients)


@pytest.mark.parametrize(  # every schedule once; each mode with fused and with split backwards (not all 8)
    "schedule, sequence_parallel",
    [("1f1b", False), ("zb-h1", True), ("zb-v", False), ("interleaved", True)],
    ids=["1f1b-tp", "zb-h1-tp+sp", "zb-v-tp", "interleaved-tp+sp"],
)
def test_pp2_tp2_trains_like_one_process(tmp_path, token_file, schedule, sequence_parallel):
    spec = llama_spec(tmp_path, token_file, schedule, tp=2, sequence_parallel=sequence_parallel, record_gradients=True)
    results = run_local(spec)
    assert_trains_like_one_process(spec, results)
    for result in results:  # the rank's objects hold its shards and nothing more: the plan's static bytes
        assert result.held_bytes["parameters"] == sum(result.planned_static_bytes.values()) > 0
    # each tensor-parallel rank sends its sequence shard: the group sends what one rank did without tp
    layout = spec.parallelism.layout
    alone = run_in_process(llama_spec(tmp_path, token_file, schedule, steps=1)) if schedule == "1f1b" else None
    for device in range(2):
        shards = [results[layout.rank(0, device, t)].records[-1].sent_bytes for t in range(2)]
        assert shards[0] == shards[1] > 0
        if alone is not None:
            assert sum(shards) == alone[device].records[-1].sent_bytes
    # and its collectives move what the planner prices, byte for byte
    stages = spec.schedule.num_stages
    _, predicted = planner_for(sequence_parallel).tp_step(spec.schedule, [max(2, stages) // stages] * stages, 2)
    for device in range(2):
        for t in range(2):
            assert results[layout.rank(0, device, t)].records[-1].tp_sent_bytes == pytest.approx(predicted[device])


def planner_for(sequence_parallel: bool):
    """The profiled cost model of this LLaMA (its fits do not matter for the collectives' bytes)."""
    from pipeloom.profile_format import PROFILE_FORMAT
    from pipeloom.tune.presets import model_from_config
    from pipeloom.tune.profiled import ProfiledCostModel

    model = model_from_config(LLAMA, name="llama").to_dict() | {"seq_len": SEQ}
    line = {"latency_ms": 0.1, "bytes_per_ms": 1e5}
    zero = {"per_layer": 0.0, "first": 0.0, "last": 0.0, "middle": 0.0, "single": 0.0}
    profile = {
        "format": PROFILE_FORMAT,
        "model": model,
        "layouts": {"plain": {"fits": {"2": {key: zero for key in ("F", "B", "W", "R", "M_B", "M_W", "M_ckpt")}}}},
        "params": {"layer": 1, "first": 1, "last": 1},
        "static_bytes_per_param": 16,
        "links": {name: line for name in ("p2p", "allreduce", "reduce_scatter", "all_gather")},
        "overheads": {"optimizer": {"base_ms": 0.0}},
    }
    return ProfiledCostModel(profile, tp=2, sequence_parallel=sequence_parallel)


def test_pp2_dp2_tp2_with_zero1_trains_like_one_process(tmp_path, token_file):
    spec = llama_spec(tmp_path, token_file, "zb-h1", tp=2, dp=2, zero=1, sequence_parallel=True)
    results = run_local(spec)
    assert len(results) == 8
    assert_matches_reference(spec, results, rtol=1e-5, atol=1e-6)


def test_the_global_norm_under_tp_counts_every_shard_once(tmp_path, token_file):
    """Clipping, post-validation and the non-finite skip under pp2 × tp2: each rank counts its
    shards, the group's first rank the replicated weights (norms), so the global norm is the
    pipeline's without tensor parallelism — a doubled or missing sum over the group would move
    it by up to √2 — and a NaN on one stage skips the step on every rank."""
    faults = ((1, 1, "nan", 0.0),)
    changes = dict(steps=3, clip_norm=0.05, lr=1e-3, gradient_faults=faults)
    plain = run_local(llama_spec(tmp_path, token_file, "1f1b", **changes))
    norms = plain[0].grad_norms
    assert len(norms) == 3 and norms[0] > 0.05 and norms[2] > 0.05  # clipping acts
    tensor = run_local(llama_spec(tmp_path, token_file, "1f1b", tp=2, **changes))
    post = llama_spec(tmp_path, token_file, "1f1b", tp=2, sequence_parallel=True, post_validation=True, **changes)
    validated = run_local(post)
    for run in (tensor, validated):
        assert run[0].losses == pytest.approx(plain[0].losses, rel=1e-5)
        for result in run:
            assert result.grad_norms == pytest.approx(norms, rel=1e-5, nan_ok=True)
            assert result.skipped_steps == 1
    from pipeloom.runtime.report import summary

    summarised = summary(tensor)["grad_norms"]  # JSON: the NaN step's norm is null
    assert summarised[1] is None and summarised[0] == pytest.approx(norms[0], rel=1e-5)
    # device 0 stepped under its partial state (its own stage, both shards) and was overturned
    # every step: by the full norm's coefficient, and by the NaN downstream
    layout = RankLayout(2, 1, 2)
    assert [validated[layout.rank(0, 0, t)].rollbacks for t in range(2)] == [3, 3]
    assert [validated[layout.rank(0, 1, t)].rollbacks for t in range(2)] == [0, 0]


def test_a_checkpoint_of_packed_projections_resumes_only_on_its_own_tp(tmp_path):
    """Each cut weight is saved under the whole weight's name, so a tp checkpoint resumes under
    another tp and pipeline (test_layout_matrix's resume matrix); a model that packs q, k and v
    in one weight (GPT-2) saves its shards of the packed weight, which no other cut reads: refused
    in one line."""
    gpt2 = hf_workload(model_dir(tmp_path, OTHERS["gpt2"]), microbatch_size=2, seq_len=SEQ)
    packed = TrainSpec(
        build_schedule("1f1b", 1, 2), workload=gpt2, tp=2, steps=1, save_every=1, save_dir=str(tmp_path / "g")
    )
    run_local(packed)
    with pytest.raises(ConfigError, match="packs several projections in one weight"):
        check_spec(packed.changed(tp=1, steps=2, save_every=0, save_dir=None, resume_dir=str(tmp_path / "g")))


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixtures_of_experts_train_under_tp_like_one_process(tmp_path, token_file, family):
    """Attention split over the group, the MoE block whole on every rank (it sees the replicated
    hidden states): Mixtral's load-balancing loss joins the vocabulary-parallel loss, Qwen3's
    per-head q/k norms have their gradients summed over the group."""
    from pipeloom.data import TokenFile

    work = hf_workload(
        model_dir(tmp_path, TINY[family]), seed=1, microbatch_size=2, seq_len=SEQ, data=TokenFile(token_file, SEQ, 2)
    )
    spec = TrainSpec(build_schedule("1f1b", 2, 2), workload=work, lr=LR, tp=2, record_gradients=True)
    results = run_local(spec)
    assert_trains_like_one_process(spec, results)
    with pytest.raises(ConfigError, match="runs its experts whole on every tensor-parallel rank"):
        check_spec(dataclasses.replace(spec, sequence_parallel=True))
    # each stage's two tp ranks hold what the profile prices, but for the norms (priced cut, held whole)
    priced = priced_params(work, TINY[family], [1, 1], tp=2)
    for result in results:
        stage = 0 if any("embed" in record.name for record in result.placements) else 1
        held = sum(math.prod(record.local_shape) for record in result.placements)
        norms = sum(record.shape[0] for record in result.placements if "norm" in record.name)
        assert held - priced[stage] == norms / 2 and norms <= 4 * 32 + 32  # two (Qwen3: four) a layer, and the last


def priced_params(work, config: dict, counts: list[int], tp: int) -> list[float]:
    """What the profiled cost model prices a rank of each stage to hold, from the parameters a
    profile of `work`'s model counts (`profiler._params`)."""
    from pipeloom.profile.profiler import _params
    from pipeloom.profile_format import Fit, Layout, LayoutProfile, LinearCost, Link, Links, Overheads, Profile
    from pipeloom.tune.presets import model_from_config
    from pipeloom.tune.profiled import ProfiledCostModel

    model = model_from_config(config)
    link = Link(0.0, 1.0)
    profile = Profile(
        model=model,
        params=_params(model, lambda layers, mbs: work),
        static_bytes_per_param=16,
        links=Links(link, link, link, link),
        layouts={Layout(): LayoutProfile(fits={1: {"F": Fit(1.0, 1.0)}})},
        overheads=Overheads(LinearCost(0.0)),
    )
    return ProfiledCostModel(profile, tp=tp).stage_params(counts)


@pytest.mark.parametrize("family", sorted(OTHERS))
def test_other_families_train_like_one_process(tmp_path, token_file, family):
    from pipeloom.data import TokenFile

    work = hf_workload(
        model_dir(tmp_path, OTHERS[family]), seed=1, microbatch_size=2, seq_len=SEQ, data=TokenFile(token_file, SEQ, 2)
    )
    spec = TrainSpec(build_schedule("zb-h1", 2, 2), workload=work, lr=LR, tp=2, sequence_parallel=family != "qwen2")
    results = run_local(spec)
    assert_matches_reference(spec, results, rtol=1e-5, atol=1e-6)
    for result in results:  # shards only (BERT's padding row kept out of its gradient without a stored mask)
        assert result.held_bytes["parameters"] == sum(result.planned_static_bytes.values())


def test_the_cli_trains_a_token_file_with_tp_and_sequence_parallelism(tmp_path, token_file, capsys):
    from pipeloom.cli import main

    model = model_dir(tmp_path, LLAMA)
    flags = ["--schedule", "zb-h1", "-p", "2", "-m", "2", "--tp", "2", "--sequence-parallel", "--steps", "2"]
    flags += ["--model", f"hf:{model}", "--data", str(token_file), "--seq-len", str(SEQ), "--quiet"]
    summary = tmp_path / "summary.json"
    assert main(["train", "--nproc", "4", *flags, "--summary", str(summary)]) == 0
    out = capsys.readouterr().out
    assert "p=2 dp=1 tp=2 (sequence parallel)" in out and "TP MiB/step" in out
    facts = json.loads(summary.read_text())
    assert facts["tp"] == 2 and len(facts["losses"]) == 2
    assert all(rank["tp_sent_bytes_per_step"] > 0 for rank in facts["ranks"])
    assert main(["train", "--nproc", "2", *flags]) == 2  # p × dp × tp = 4
    assert "does not match p × dp × tp = 2 × 1 × 2 = 4" in capsys.readouterr().err


def test_rank_layout_puts_tensor_parallelism_innermost():
    layout = RankLayout(devices=2, dp=2, tp=2)
    assert [layout.rank(0, 0, t) for t in range(2)] == [0, 1]  # one node's consecutive ranks
    assert layout.rank(1, 0, 0) == 2 and layout.rank(0, 1, 0) == 4
    assert all(layout.rank(*layout.coords(r)) == r for r in range(layout.world_size))


@pytest.mark.parametrize(
    "family, changes, tp, sp, message",
    [
        ("llama", {"num_key_value_heads": 1}, 2, False, "1 key/value heads do not divide by --tp 2"),
        ("llama", {"vocab_size": 95}, 2, False, "95 vocabulary entries do not divide"),
        ("llama", {}, 3, False, "attention heads do not divide by --tp 3"),
        ("mamba", {"state_size": 8, "expand": 2, "conv_kernel": 4}, 2, False, "Mamba has no tensor-parallel plan"),
        ("llama", {}, 1, True, "--sequence-parallel shards the sequence"),
    ],
)
def test_models_that_cannot_be_cut_are_refused_in_one_line(tmp_path, family, changes, tp, sp, message):
    config = {**LLAMA, **changes, "model_type": family}
    work = hf_workload(model_dir(tmp_path, config), microbatch_size=2, seq_len=SEQ)
    spec = TrainSpec(build_schedule("1f1b", 2, 4), workload=work, tp=tp, sequence_parallel=sp)
    with pytest.raises(ConfigError, match=message):
        check_spec(spec)


def test_world_size_slices_and_in_process_runs_are_checked(tmp_path):
    work = hf_workload(model_dir(tmp_path, LLAMA), microbatch_size=2, seq_len=SEQ)
    spec = TrainSpec(build_schedule("1f1b", 2, 4), workload=work, tp=2)
    with pytest.raises(ConfigError, match=r"world size 2 does not match p × dp × tp = 2 × 1 × 2 = 4"):
        check_spec(spec, 2)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        run_in_process(spec)
    sliced = TrainSpec(build_schedule("svpp", 2, 4, num_slices=2), workload=work, tp=2)
    with pytest.raises(ConfigError, match="slices .* do not combine with --tp"):
        check_spec(sliced)
