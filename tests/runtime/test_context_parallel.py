"""Context parallelism: each of cp ranks holds two opposite chunks of every sequence and gathers the
others' keys and values. Its equality with one process under 1f1b, zb-h1, zb-v, with tp, ZeRO,
save/resume and evaluation is in the layout matrix (`test_layout_matrix.py`, the cp2 columns);
here: the cut, the grid, what is refused, and the CLI's run with the bytes it exchanges."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.models.context_parallel import head_tail_positions  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.layout import RankLayout  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec  # noqa: E402

TEXT = Path(__file__).resolve().parents[2] / "examples" / "train.bin"  # bytes of English text


@pytest.mark.parametrize("cp", [2, 4])
def test_head_tail_chunks_cover_the_sequence_and_balance_causal_work(cp):
    seq = 8 * cp
    held = [head_tail_positions(seq, cp, i) for i in range(cp)]
    assert sorted(torch.cat(held).tolist()) == list(range(seq))
    assert held[0].tolist()[:4] == [0, 1, 2, 3] and held[0].tolist()[-1] == seq - 1  # head and tail
    work = [int((positions + 1).sum()) for positions in held]  # keys each rank's queries see, causally
    assert len(set(work)) == 1


def test_the_grid_puts_context_parallelism_between_tp_and_dp():
    layout = RankLayout(devices=2, dp=4, tp=2, cp=2)  # dp 2 × cp 2 replicas of each weight
    assert [layout.rank(r, 0, 0) for r in range(4)] == [0, 2, 4, 6]  # a cp group: tp ranks apart
    assert [layout.samples_of(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert layout.rank(0, 1, 0) == 8 and layout.world_size == 16


def _model(tmp_path, family: str = "llama", **changes) -> Path:
    directory = tmp_path / family
    directory.mkdir(exist_ok=True)
    config = {**TINY[family], "vocab_size": 256, "num_hidden_layers": 2, **changes}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


THIRDS = dict(hidden_size=48, num_attention_heads=6, num_key_value_heads=3, intermediate_size=66, vocab_size=255)
"""A LLaMA that cuts into three tensor-parallel ranks."""


@pytest.mark.parametrize(
    "family, config, seq, schedule, extra, message",
    [
        ("gpt2", {}, 16, ("1f1b", 2, 4), {}, "hf:gpt2 cannot split its sequence over ranks"),
        ("bert", {}, 16, ("1f1b", 2, 4), {}, "hf:bert cannot split its sequence over ranks"),
        ("mixtral", {}, 16, ("1f1b", 2, 4), {}, "hf:mixtral cannot split .* without the load-balancing loss"),
        ("llama", {}, 18, ("1f1b", 2, 4), {}, "the sequence of 18 tokens does not cut into 4 equal chunks"),
        ("llama", {}, 16, ("svpp", 2, 4, 2), {}, "slices and context parallelism both cut the sequence"),
        ("llama", THIRDS, 24, ("1f1b", 2, 4), dict(cp=3, tp=3, sequence_parallel=True), "8 tokens do not cut into 3"),
    ],
    ids=["gpt2", "bert", "router-loss", "uneven", "slices", "sequence-parallel"],
)
def test_what_cannot_split_its_sequence_is_refused(tmp_path, family, config, seq, schedule, extra, message):
    name, p, m, *slices = schedule
    built = build_schedule(name, p, m, **({"num_slices": slices[0]} if slices else {}))
    work = hf_workload(_model(tmp_path, family, **config), microbatch_size=2, seq_len=seq)
    spec = TrainSpec(built, workload=work, **({"cp": 2} | extra))
    with pytest.raises(ConfigError, match=message):
        check_spec(spec)


def test_profile_refuses_a_model_that_cannot_split_its_sequence_in_its_own_name(tmp_path, capsys):
    """The runtime's check of the probe's run refuses it in one line, said by `profile`."""
    from pipeloom.cli import main

    argv = ["profile", "--model", f"hf:{_model(tmp_path, 'gpt2')}", "--seq-len", "16", "--cp", "2"]
    assert main([*argv, "--output", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pipeloom: error: profile: --cp 2: hf:gpt2 cannot split its sequence over ranks")
    assert err.count("\n") == 1 and not (tmp_path / "p.json").exists()


def test_world_size_in_process_runs_and_compilation_are_checked(tmp_path):
    work = hf_workload(_model(tmp_path), microbatch_size=2, seq_len=16)
    spec = TrainSpec(build_schedule("1f1b", 2, 4), workload=work, cp=2)
    with pytest.raises(ConfigError, match="--compile does not yet combine with --tp, --cp or --ep"):
        check_spec(TrainSpec(build_schedule("1f1b", 2, 4), workload=work, cp=2, compile=True))
    with pytest.raises(ConfigError, match=r"world size 2 does not match p × dp × cp × tp = 2 × 1 × 2 × 1 = 4"):
        check_spec(spec, 2)
    with pytest.raises(ConfigError, match="context parallelism"):
        run_in_process(spec)


@pytest.mark.slow
def test_the_cli_trains_real_text_over_cp_ranks_and_exchanges_what_the_planner_prices(tmp_path, capsys):
    from pipeloom.cli import main
    from pipeloom.tune.analytic import kv_exchange_bytes
    from pipeloom.tune.presets import model_from_config

    seq, mbs, m = 32, 2, 2
    model = _model(tmp_path)
    flags = ["--schedule", "1f1b", "-p", "2", "-m", str(m), "--cp", "2", "--steps", "2", "--microbatch-size", str(mbs)]
    flags += ["--model", f"hf:{model}", "--data", str(TEXT), "--seq-len", str(seq), "--quiet"]
    summary = tmp_path / "summary.json"
    assert main(["train", "--nproc", "4", *flags, "--summary", str(summary)]) == 0
    out = capsys.readouterr().out
    assert "p=2 dp=1 tp=1 cp=2" in out and "K/V MiB/step" in out
    facts = json.loads(summary.read_text())
    planned = dataclasses.replace(model_from_config(json.loads((model / "config.json").read_text())), seq_len=seq)
    # a layer a stage: its K and V gathered in each F and their gradients reduce-scattered in each B,
    # in fp32 (the planner counts 16-bit values)
    per_step = m * 2 * 2 * kv_exchange_bytes(planned, mbs, tp=1, cp=2)
    assert [rank["kv_sent_bytes_per_step"] for rank in facts["ranks"]] == [per_step] * 4
    assert main(["train", "--nproc", "2", *flags]) == 2
    assert "--nproc 2 does not match p × dp × cp × tp = 2 × 1 × 2 × 1 = 4" in capsys.readouterr().err


@pytest.mark.slow
def test_the_profile_measures_a_stage_over_context_parallel_ranks(tmp_path):
    """`layouts.measure_layout` of `Layout(cp=2)`: the probe schedule on one stage over two cp
    ranks, fitted at the single position — what `tune --cp 2` then prices the plan's ops by."""
    from pipeloom.profile.layouts import measure_layout
    from pipeloom.profile.probe_rounds import ProbeModel, Turns
    from pipeloom.profile_format import Layout

    directory = _model(tmp_path)
    workload_for = lambda n, mbs: hf_workload(directory, 0, mbs, 16, layers=n)  # noqa: E731
    probed = ProbeModel(None, steps=1, workload_for=workload_for)
    measured, probes = measure_layout(Layout(cp=2), probed, (2,), (1, 2), Turns().fixed(1))
    fits = measured.fits[2]
    assert {"F", "B", "W", "R", "M_B"} <= fits.keys()
    assert all(fits[kind].per_layer + fits[kind].single > 0 for kind in ("F", "B", "M_B"))
    assert all(probe.median("F@0") > 0 and probe.median("F@1") > 0 for probe in probes.values())  # both cp ranks
