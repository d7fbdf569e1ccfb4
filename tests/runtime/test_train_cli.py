"""`pipeloom train` on real models and data: one-line errors with exit status 2 for bad input,
and a run on a text file tokenized by a local tokenizer that prints the trainer's table."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from pipeloom.cli import main  # noqa: E402
from pipeloom.data import TokenFile, masked_lm, sample_corpus, train_tokenizer, write_token_file  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.runtime.plan_run import spec_from_plan  # noqa: E402

LLAMA = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "max_position_embeddings": 64,
}
BASE = ["train", "--nproc", "2", "--schedule", "1f1b", "-p", "2", "-m", "2", "--steps", "1", "--seq-len", "16"]


@pytest.fixture
def llama(tmp_path):
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps(LLAMA))
    return tmp_path / "llama"


def refused(capsys, *argv):
    code = main([*BASE, *argv])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_bad_models_data_and_devices_exit_2_with_one_line(capsys, tmp_path, llama):
    assert "does not exist" in refused(capsys, "--model", f"hf:{tmp_path / 'nowhere'}")
    (tmp_path / "empty").mkdir()
    assert "has no config.json" in refused(capsys, "--model", f"hf:{tmp_path / 'empty'}")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    assert "cannot read" in refused(capsys, "--model", f"hf:{tmp_path / 'broken'}")
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text('{"model_type": "t5"}')
    assert "'t5' is not supported" in refused(capsys, "--model", f"hf:{tmp_path / 't5'}")
    (tmp_path / "heads").mkdir()  # Mixtral's default of 8 K/V heads under 2 heads failed in the first forward
    (tmp_path / "heads" / "config.json").write_text(json.dumps({**LLAMA, "model_type": "mixtral"}))
    assert "2 attention heads do not group over 8 key/value heads" in refused(
        capsys, "--model", f"hf:{tmp_path / 'heads'}"
    )
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    assert "not a multiple of uint16" in refused(capsys, "--model", f"hf:{llama}", "--data", str(tmp_path / "odd.bin"))
    (tmp_path / "empty.bin").write_bytes(b"")
    assert "is empty: it holds no tokens" in refused(
        capsys, "--model", f"hf:{llama}", "--data", str(tmp_path / "empty.bin")
    )
    write_token_file(tmp_path / "ids.bin", list(range(100)))  # a token file given as text
    assert "is not UTF-8 text (it holds NUL bytes)" in refused(
        capsys, "--model", f"hf:{llama}", "--data", str(tmp_path / "ids.bin"), "--tokenizer", str(llama)
    )
    write_token_file(tmp_path / "big.bin", list(range(600)))
    assert "beyond the model's vocabulary of 512" in refused(
        capsys, "--model", f"hf:{llama}", "--data", str(tmp_path / "big.bin")
    )
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in refused(capsys, "--device", "cuda")
    assert "2 layers cannot be cut into 4 stages" in refused(capsys, "--model", f"hf:{llama}", "-p", "4", "-m", "4")


def test_text_data_through_a_local_tokenizer_trains_and_reports(capsys, tmp_path, llama):
    text = tmp_path / "corpus.txt"
    text.write_text(sample_corpus(40_000))
    tokenizer = train_tokenizer(tmp_path / "tokenizer", text.read_text(), vocab_size=512)
    summary = tmp_path / "summary.json"
    code = main(
        [
            *BASE,
            "--steps",
            "3",
            "--model",
            f"hf:{llama}",
            "--data",
            str(text),
            "--tokenizer",
            str(tokenizer),
            "--dtype",
            "bf16",
            "--zero",
            "1",
            "--peak-tflops",
            "1",
            "--summary",
            str(summary),
        ]
    )
    out, _ = capsys.readouterr()
    assert code == 0
    assert "tokens/s" in out and "TFLOP/s" in out and "MFU" in out and "hf:llama" in out
    assert "ZeRO-1" in out and "optimizer MiB (plan)" in out
    facts = json.loads(summary.read_text())
    assert facts["tokens_per_second"] > 0 and len(facts["tflops_per_rank"]) == 2
    assert all(0 < mfu < 1 for mfu in facts["mfu_per_rank"])
    assert facts["ranks"][0]["sent_dtypes"] == ["bfloat16"] and facts["dtype"] == "bf16"
    for rank in facts["ranks"]:  # bf16 weights, fp32 gradients, the fp32 master and moments: as planned
        assert rank["static_bytes"] == rank["planned_static_bytes"]
        assert rank["static_bytes"]["optimizer"] == 6 * rank["static_bytes"]["weights"]


def test_token_samples_are_deterministic_and_per_replica(tmp_path):
    path = write_token_file(tmp_path / "t.u32", list(range(70_000)), "uint32")
    data = TokenFile(path, seq_len=8, seed=1)
    assert data.dtype == "uint32" and data.vocab_limit == 70_000
    first, targets = data.batch(6, step=3)
    again, _ = data.batch(6, step=3)
    assert torch.equal(first, again) and not torch.equal(first, data.batch(6, step=4)[0])
    assert torch.equal(first[:, 1:], targets[:, :-1])  # next-token targets from one window
    with pytest.raises(ConfigError, match="fewer than one sequence"):
        TokenFile(write_token_file(tmp_path / "short.bin", [1, 2, 3]), seq_len=8, seed=0)


def test_masked_lm_masks_some_positions_and_ignores_the_rest(tmp_path):
    data = TokenFile(write_token_file(tmp_path / "t.bin", [i % 50 for i in range(5000)]), seq_len=32, seed=0)
    inputs, targets = masked_lm(data, vocab=64, seed=0)(8, 0)
    masked = targets != -100
    assert masked.any(dim=1).all() and 0.05 < masked.float().mean() < 0.3
    assert (inputs[masked] == 63).all() and (inputs[~masked] < 50).all()


def test_profile_tune_and_train_a_hugging_face_model(capsys, tmp_path, llama):
    """profile --model hf:DIR times the model's own layers (on the run's tokens, --data); the plan tuned on it trains that model
    (not the built-in decoder) on the data and in the type the plan records, and its activation
    memory is predicted to the byte."""
    profile, plan = tmp_path / "profile.json", tmp_path / "plan.json"
    tokens = write_token_file(tmp_path / "train.bin", torch.randint(0, 512, (4096,)).numpy())
    assert (
        main(
            [
                "profile",
                "--model",
                f"hf:{llama}",
                "--mbs",
                "1",
                "--layers",
                "1,2",
                "--seq-len",
                "16",
                "--steps",
                "1",
                "--max-rounds",
                "2",
                "--tp",
                "2",
                "--data",  # the probes train on the run's tokens
                str(tokens),
                "--output",
                str(profile),
            ]
        )
        == 0
    )
    facts = json.loads(profile.read_text())
    assert facts["source"] == f"hf:{llama}" and facts["params"]["first"] == 512 * 32
    assert facts["data"] == f"token file {str(tokens.resolve())!r} (uint16, 8.0 KiB)"
    measured = facts["layouts"]["tp2"]["fits"]["1"]  # its ops on one stage over two ranks, as `tune --tp 2` prices them
    assert facts["layouts"]["tp2"]["layers"] == facts["layouts"]["plain"]["layers"] == [1, 2]
    assert (
        # the W queue, the sync phase, a fused backward and its forward
        set(measured) == {"F", "B", "W", "R", "BW", "F_BW", "M_B", "M_ckpt", "M_W", "sync"}
        and measured["F"]["per_layer"] + measured["F"]["single"] > 0
    )
    assert "mbs 1 on tp2: per layer F" in capsys.readouterr().out
    for sequence_parallel in (False, True):  # priced as measured; a layout it did not measure is warned of
        flags = ["--tp", "2", *(["--sequence-parallel"] if sequence_parallel else [])]
        tuned = ["tune", "--costs", str(profile), "--devices", "2", "--memory", "1GiB", "--global-batch", "4"]
        assert main([*tuned, *flags, "--max-mbs", "1", "--output", str(tmp_path / f"tp-{sequence_parallel}.json")]) == 0
        warned = "measured no ops on 2 tensor-parallel ranks" in capsys.readouterr().err
        assert warned == sequence_parallel
        tuned_plan = json.loads((tmp_path / f"tp-{sequence_parallel}.json").read_text())
        assert tuned_plan["sequence_parallel"] == sequence_parallel  # asked of the unsplit model: kept for tp 2
    assert main(["train", "--plan", str(tmp_path / "tp-True.json"), "--steps", "1"]) == 0  # runs as planned
    assert "tp=2 (sequence parallel)" in capsys.readouterr().out  # its stash estimated: the profile ran no +sp
    assert main(["train", "--plan", str(tmp_path / "tp-False.json"), "--sequence-parallel"]) == 2
    assert "--plan fixes sequence parallelism off" in capsys.readouterr().err
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
                "--runnable",
                "--max-mbs",
                "1",
                "--schemes",
                "1f1b",
                "--pp",
                "2",  # pinned: on a noisy machine pp=1 dp=2 (ZeRO-1) may time faster
                "--data",
                str(tokens),
                "--output",
                str(plan),
            ]
        )
        == 0
    )
    capsys.readouterr()
    inputs = json.loads(plan.read_text())["inputs"]
    assert inputs["dtype"] == "fp32" and inputs["data"]["path"] == str(tokens.resolve())
    assert main(["train", "--plan", str(plan), "--steps", "2"]) == 0
    out, _ = capsys.readouterr()
    assert "hf:llama" in out and f"data: token file {str(tokens.resolve())!r} (uint16, 8.0 KiB)" in out.splitlines()
    activations = [line for line in out.splitlines() if "activations" in line]
    assert len(activations) == 2 and all(line.endswith("(+0.0%)") for line in activations)
    static = [line for line in out.splitlines() if " static " in line]
    assert len(static) == 2 and all("(+0.0%;" in line for line in static)  # ZeRO-0: 16 bytes per weight
    edited = json.loads(plan.read_text())
    edited["inputs"]["dtype"] = "bf16"
    plan.write_text(json.dumps(edited))
    spec = spec_from_plan(plan)
    assert spec.dtype == "bf16" and spec.resolved_workload().data == inputs["data"]
    tokens.unlink()
    with pytest.raises(ConfigError, match="the plan was made for token file .* does not exist here: give --data"):
        spec_from_plan(plan)


def test_another_model_given_to_a_plan_is_named_by_how_it_differs(tmp_path, llama):
    """`train --plan P --model hf:OTHER` trains OTHER cut as planned, but the plan's prediction is
    of its own model: a model of another shape is named by its differences (a GPT-2 once ran
    silently under a Qwen2 plan, its error read as the plan's)."""
    from pipeloom.cli.plan import _model_changes
    from pipeloom.tune.presets import model_from_config

    planned = model_from_config(LLAMA)
    assert _model_changes(planned, f"hf:{llama}") == []
    other = tmp_path / "wider"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**LLAMA, "intermediate_size": 128, "num_key_value_heads": 1}))
    assert _model_changes(planned, f"hf:{other}") == ["kv_heads 2, not 1", "ffn 64, not 128"]


def test_partial_recompute_flags_are_checked_before_any_rank_starts(capsys):
    assert "checkpoints nothing; add --ckpt full or mario" in refused(capsys, "--recompute-layers", "1")
    assert "positive number of layers" in refused(capsys, "--ckpt", "full", "--recompute-layers", "0")
    sliced = ["--schedule", "svpp", "-v", "1", "--slices", "2", "--ckpt", "full", "--recompute-layers", "1"]
    assert "slice by slice" in refused(capsys, *sliced)


def test_a_model_too_big_for_this_machine_is_refused_before_it_is_built(capsys, tmp_path, monkeypatch):
    """`{"model_type": "llama"}` alone is transformers' default 6.7 B LLaMA: it was built in fp32
    on every rank until memory ran out. Counted on the meta device, it is refused with its size."""
    from pipeloom.models import memory_guard

    monkeypatch.setattr(memory_guard, "available_memory", lambda: 8 * 2**30)  # any machine: 8 GiB free
    (tmp_path / "defaults").mkdir()
    (tmp_path / "defaults" / "config.json").write_text('{"model_type": "llama"}')
    err = refused(capsys, "--model", f"hf:{tmp_path / 'defaults'}")
    assert "6.74 B parameters" in err and "100.4 GiB" in err and "8.0 GiB available" in err
    memory_guard.check_trainable_here(10**6, available=8 * 2**30)  # a million parameters fit in 8 GiB
    with pytest.raises(ConfigError, match="1.00 B parameters"):
        memory_guard.check_trainable_here(10**9, available=8 * 2**30)


def test_a_micro_batch_too_big_for_this_machine_is_refused_with_what_fits(capsys, monkeypatch):
    """`--microbatch-size 100000` swapped for minutes: one micro-batch's stash, measured by the
    probe on fake tensors (autograd's saved tensors per stage), is weighed against the host."""
    from pipeloom import build_schedule
    from pipeloom.models import memory_guard
    from pipeloom.models.llama import LlamaConfig
    from pipeloom.runtime.in_process import run_in_process
    from pipeloom.runtime.probe import probe_spec
    from pipeloom.runtime.training import TrainSpec

    monkeypatch.setattr(memory_guard, "available_memory", lambda: 8 * 2**30)
    err = refused(capsys, "--microbatch-size", "100000", "--seq-len", "32")
    assert "a micro-batch of 100,000 sequences × 32 tokens leaves 60.6 GiB" in err and "8.0 GiB available" in err
    assert "(at most 13,2" in err  # 60.6 GiB / 100,000 sequences into 8 GiB
    spec = TrainSpec(build_schedule("gpipe", 2, 1), config=LlamaConfig(microbatch_size=2), steps=1)
    probed = probe_spec(spec).stash_bytes
    measured = [max(r.peak_stash_bytes for r in result.records) for result in run_in_process(spec)]
    for estimate, stash in zip(probed, measured, strict=True):  # the saved tensors the runtime counts,
        assert 0.75 < estimate / stash < 1.25  # less its inputs and loss, with views counted apart


def test_unreadable_weights_and_unmakeable_directories_are_named_before_any_rank_starts(capsys, tmp_path, llama):
    """A truncated safetensors file surfaced as "rank 0 failed: SafetensorError", a --log-dir
    that is a file as "rank 0 failed: ... connection closed by peer": both now name the file."""
    from pipeloom.models.compat import import_transformers

    transformers = import_transformers()
    config = transformers.AutoConfig.for_model(**LLAMA)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "weights")
    weights = tmp_path / "weights" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:5000])
    capsys.readouterr()  # the library's own progress while saving
    err = refused(capsys, "--model", f"hf:{tmp_path / 'weights'}")
    assert f"cannot load the weights in {str(tmp_path / 'weights')!r} (model.safetensors): SafetensorError" in err
    (tmp_path / "afile").write_text("")
    assert f"--log-dir {str(tmp_path / 'afile')!r}: it is a file" in refused(
        capsys, "--log-dir", str(tmp_path / "afile")
    )
    err = refused(capsys, "--save", str(tmp_path / "afile" / "ck"), "--save-every", "1")
    assert f"{str(tmp_path / 'afile')!r} is a file, not a directory" in err


def test_a_run_into_another_runs_checkpoints_is_refused_before_its_header(capsys, tmp_path, llama):
    """A later run into a finished run's --save overwrote its step-N and left both runs' checkpoints
    side by side, so --resume picked the other run's newest step."""
    (tmp_path / "ck" / "step-1").mkdir(parents=True)
    err = refused(capsys, "--model", f"hf:{llama}", "--save", str(tmp_path / "ck"), "--save-every", "1")
    assert "holds another run's files: step-1; continue that run with --resume" in err and "--force" in err
    assert sorted(path.name for path in (tmp_path / "ck").iterdir()) == [".lock", "step-1"]


def test_ranks_whose_threads_outnumber_the_cores_are_named_at_launch():
    """A run of more CPU ranks × threads than cores shares them (what `tune` priced as a core a
    rank): the header says so; GPU ranks, or a run that fits, print nothing."""
    import os
    from types import SimpleNamespace

    from pipeloom.cli.train import _shared_cores

    cores = len(os.sched_getaffinity(0))

    def spec(ranks: int, threads: int = 1, device: str = "cpu"):
        layout = SimpleNamespace(world_size=ranks)
        return SimpleNamespace(parallelism=SimpleNamespace(layout=layout), threads=threads, torch_device_type=device)

    line = _shared_cores(spec(2 * cores))
    assert (
        line
        == f"ranks: {2 * cores} × 1 thread(s) on this machine's {cores} cores: they share them, each op up to 2× slower than on a core of its own"
    )
    assert _shared_cores(spec(cores)) is None and _shared_cores(spec(4 * cores, device="cuda")) is None
    assert "up to 4×" in _shared_cores(spec(cores, threads=4))
