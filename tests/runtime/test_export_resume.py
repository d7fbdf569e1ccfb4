"""Checkpoints that leave pipeloom and change layout: export to a transformers directory, and resume
under another schedule or pipeline size (weights keyed by their names in the model)."""

import dataclasses
import json
import math
import os
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402

from pipeloom import ConfigError, build_schedule  # noqa: E402
from pipeloom.cli import main  # noqa: E402
from pipeloom.data import TokenFile, write_token_file  # noqa: E402
from pipeloom.models.compat import import_transformers  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.models.workload import global_names  # noqa: E402
from pipeloom.runtime.export import export_checkpoint  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

SEQ = 16


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    """A tied-embedding LLaMA directory and held-out tokens."""
    root = tmp_path_factory.mktemp("export")
    (root / "model").mkdir()
    (root / "model" / "config.json").write_text(json.dumps(TINY["llama"]))
    generator = torch.Generator().manual_seed(3)
    write_token_file(root / "val.bin", torch.randint(0, 96, (2000,), generator=generator).tolist())
    return root


def spec_of(root, schedule, **changes):
    work = hf_workload(root / "model", seed=4, microbatch_size=2, seq_len=SEQ)
    held_out = TokenFile(root / "val.bin", SEQ, 4)
    return TrainSpec(
        schedule, workload=work, steps=5, lr=2e-3, lr_schedule="cosine", warmup_steps=1, eval_data=held_out.batch,
        eval_batches=2, **changes
    )  # fmt: skip


def test_export_of_a_pipeline_equals_one_process_and_loads_in_transformers(tiny_llama, tmp_path):
    spec = spec_of(tiny_llama, build_schedule("zb-h1", 2, 2), save_every=5, save_dir=str(tmp_path / "ck"), eval_every=5)
    results = run_local(spec)
    main(["export", str(tmp_path / "ck" / "step-5"), "--output", str(tmp_path / "hf")])
    mask = os.umask(0)
    os.umask(mask)
    assert [path.stat().st_mode & 0o777 for path in (tmp_path / "hf").glob("*.safetensors")] == [0o666 & ~mask]
    transformers = import_transformers()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    _, weights = reference_training(spec)  # the same training in one process
    names = global_names(spec.resolved_workload().build(2))
    exported = dict(model.named_parameters())
    for stage, parameters in enumerate(weights):
        for local, value in parameters.items():
            torch.testing.assert_close(exported[names[stage][local]].detach(), value, rtol=1e-5, atol=1e-6)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    losses = []  # the pipeline's evaluation after step 5, as transformers computes it
    with torch.no_grad():
        for index in range(2):
            inputs, targets = spec.eval_data(2 * 2, index)
            for j in range(2):
                logits = model(inputs[2 * j : 2 * j + 2]).logits
                losses.append(
                    float(
                        torch.nn.functional.cross_entropy(
                            logits.reshape(-1, 96), targets[2 * j : 2 * j + 2].reshape(-1)
                        )
                    )
                )
    assert results[0].eval_losses == [(5, pytest.approx(sum(losses) / len(losses), rel=1e-5))]
    with pytest.raises(ConfigError, match="no checkpoint"):
        export_checkpoint(tmp_path / "nothing", tmp_path / "out")
    damaged = tmp_path / "damaged" / "step-5"  # a shard cut short (a copy interrupted): was a traceback
    shutil.copytree(tmp_path / "ck" / "step-5", damaged)
    shard = sorted(damaged.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(ConfigError, match="is damaged or does not fit its model: RuntimeError: PytorchStreamReader"):
        export_checkpoint(damaged, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_export_cut_short_says_so_in_one_line_and_leaves_no_half_written_model(
    tiny_llama, tmp_path, monkeypatch, capsys
):
    """Ctrl-C during `export` printed a traceback and left whatever save_pretrained had written."""
    import pipeloom.runtime.export as export

    run_local(spec_of(tiny_llama, build_schedule("1f1b", 1, 2), save_every=5, save_dir=str(tmp_path / "ck")))

    def interrupted(directory):
        assert (directory / "config.json").exists()  # written, not yet moved under --output
        raise KeyboardInterrupt

    monkeypatch.setattr(export, "_as_the_umask_allows", interrupted)
    assert main(["export", str(tmp_path / "ck" / "step-5"), "--output", str(tmp_path / "hf")]) == 130
    err = capsys.readouterr().err  # beside transformers' own progress bar
    assert err.strip().splitlines()[-1] == "pipeloom: stopped by SIGINT" and "Traceback" not in err
    assert list((tmp_path / "hf").iterdir()) == [] and not list(tmp_path.glob(".hf.partial-*"))
    # nor into a training run's directories, with --force or not: its own, or another's (found by the fuzz)
    for output in (tmp_path / "ck", tmp_path / "ck" / "step-5" / "hf"):
        code = main(["export", str(tmp_path / "ck"), "--output", str(output), "--force"])
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and ("holds a training run's" in err or "lies inside" in err)
    assert sorted(path.name for path in (tmp_path / "ck").iterdir()) == [".lock", ".run", "step-5"]


@pytest.mark.parametrize("apart", ["zero1", "offload"])
def test_export_of_a_bf16_run_writes_the_fp32_masters(tiny_llama, tmp_path, apart):
    """Under ZeRO-1 (masters sharded over the replicas) or host offload (masters on the host) a bf16
    run computes with bf16 copies of fp32 masters; the export writes the masters: each exported
    weight rounds to the run's bf16 copy exactly, and most are not bf16 values themselves."""
    schedule = build_schedule("1f1b", 2, 2)
    changes = dict(dtype="bf16", steps=3, lr=1e-2, lr_schedule="constant", warmup_steps=0, eval_data=None)
    layout = {"zero1": dict(dp=2, zero=1), "offload": dict(offload_stages=(1,))}[apart]
    spec = dataclasses.replace(spec_of(tiny_llama, schedule), **changes, **layout)
    results = run_local(dataclasses.replace(spec, save_every=3, save_dir=str(tmp_path / "ck")))
    export_checkpoint(tmp_path / "ck", tmp_path / "hf")
    model = import_transformers().AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"))
    exported = dict(model.named_parameters())
    names = global_names(spec.resolved_workload().build(2))
    apart_stages = set(layout.get("offload_stages", (0, 1)))
    widened, total = 0, 0
    for result in results:
        for stage, parameters in result.parameters.items():
            for local, copy in parameters.items():
                if stage not in apart_stages:
                    continue
                weight = exported[names[stage][local]].detach()
                assert copy.dtype == torch.bfloat16 and torch.equal(weight.to(torch.bfloat16), copy), local
                widened += int((weight == copy.float()).sum())
                total += weight.numel()
    assert total and widened < total / 4  # fp32 masters, not the bf16 copies widened


def test_resume_under_another_schedule_and_pipeline_size(tiny_llama, tmp_path, capfd):
    whole = run_local(spec_of(tiny_llama, build_schedule("1f1b", 2, 2), save_every=2, save_dir=str(tmp_path)))
    for schedule in (build_schedule("zb-v", 2, 2), build_schedule("1f1b", 1, 2)):
        resumed = run_local(
            spec_of(tiny_llama, schedule, resume_dir=str(tmp_path / "step-2")), progress=schedule.num_devices == 1
        )
        assert resumed[0].losses == pytest.approx(whole[0].losses[2:], rel=1e-6)
        assert resumed[0].learning_rates == whole[0].learning_rates[2:]  # the curve goes on where it stopped
        assert not math.isclose(resumed[0].learning_rates[0], resumed[0].learning_rates[1])
    printed = capfd.readouterr().out  # run_local(progress=True) prints as the CLI does
    assert "step 2: loss" in printed and "median step" in printed and "validation loss" not in printed


def test_a_checkpoint_resumes_only_into_a_model_that_holds_all_its_weights(tiny_llama, tmp_path):
    """An untied head resumed into a model that ties it to its embeddings was dropped, and the run
    said "resumed": every rank now refuses, naming the weight (its reverse, a tied checkpoint into an
    untied model, was refused already: the head is missing)."""
    from pipeloom.errors import RuntimeFault

    untied = tmp_path / "untied"
    untied.mkdir()
    (untied / "config.json").write_text(json.dumps({**TINY["llama"], "tie_word_embeddings": False}))
    schedule = build_schedule("1f1b", 1, 2)
    saved = TrainSpec(schedule, workload=hf_workload(untied, seed=1, microbatch_size=2, seq_len=SEQ), steps=1)
    run_local(saved.changed(save_every=1, save_dir=str(tmp_path / "ck")))
    tied = TrainSpec(schedule, workload=hf_workload(tiny_llama / "model", seed=1, microbatch_size=2, seq_len=SEQ))
    with pytest.raises(RuntimeFault, match=r"holds lm_head\.weight, which this run's model has no place for"):
        run_local(tied.changed(steps=2, resume_dir=str(tmp_path / "ck")))


def test_a_resumed_run_keeps_its_learning_rate_curve_unless_told_otherwise(tmp_path, capfd):
    """A resume with `--lr 0.05` printed 0.05 and trained at the checkpoint's rate, and one with more
    --steps lengthened a finished cosine, whose rate climbed back up. Now the flags not given are
    the checkpoint's; one given changes the curve from the resumed step on, said in one line; and
    lengthening an ended decay is refused with its two ways on."""
    from pipeloom.cli import build_parser, subcommand
    from pipeloom.cli.config_file import config_line
    from pipeloom.cli.train_args import check_train_flags
    from pipeloom.runtime.lr_schedule import LRCurve, LRSchedule

    run = ["train", "1f1b", "-p", "1", "-m", "2", "--nproc", "1", "--layers", "2", "--hidden", "32", "--heads", "2"]
    run += ["--ffn", "64", "--seq-len", "16"]
    cosine = ["--lr", "0.05", "--lr-schedule", "cosine", "--warmup-steps", "1", "--min-lr", "0.001"]
    ck = tmp_path / "ck"

    def summary(*argv):
        path = tmp_path / f"summary-{len(list(tmp_path.glob('summary-*')))}.json"
        assert main([*run, *argv, "--summary", str(path)]) == 0
        return json.loads(path.read_text())["learning_rates"], capfd.readouterr().out

    whole, _ = summary(*cosine, "--steps", "4", "--save", str(ck), "--save-every", "2")
    shape = LRSchedule("cosine", 1, 0.001)
    assert whole == [LRCurve(0.05, shape, 4).rate_at(step) for step in range(4)]

    parser = build_parser()
    args = parser.parse_args([*run, "--resume", str(ck / "step-2")])
    check_train_flags(args)  # what the header prints: the checkpoint's curve and length
    assert (args.lr, args.lr_schedule, args.warmup_steps, args.min_lr, args.steps) == (0.05, "cosine", 1, 0.001, 4)
    line = config_line(args, subcommand(parser, "train"))
    assert "lr=0.05 " in line and "lr-schedule=cosine" in line and "min-lr=0.001" in line

    rates, out = summary("--resume", str(ck / "step-2"), "--lr", "0.02")
    changed = LRCurve(0.02, shape, 4)
    assert rates == [changed.rate_at(2), changed.rate_at(3)]
    assert f"learning rate from step 2: {changed} (was {LRCurve(0.05, shape, 4)}); step 2 trains at" in out

    code = main([*run, "--resume", str(ck), "--steps", "6"])
    _, err = capfd.readouterr()
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "ended at step 4; --steps 6 would lengthen it and the rate would climb back to" in err
    assert "--lr-schedule constant --lr 0.001 --warmup-steps 0" in err and "--lr-restart" in err

    rates, out = summary("--resume", str(ck), "--steps", "7", "--lr-restart", "--lr", "0.01", "--warmup-steps", "0")
    restarted = LRCurve(0.01, LRSchedule("cosine", 0, 0.001), 7, start=4)
    assert rates == [restarted.rate_at(step) for step in (4, 5, 6)] and rates[0] == 0.01 and rates[-1] == 0.001
    assert "learning rate from step 4: cosine from 0.01 to 0.001 over steps 4–7" in out
