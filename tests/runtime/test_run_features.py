"""What makes a run one you would launch, checked in one process: the learning-rate curve, held-out
evaluation as a forward-only pipeline, the metrics log and the config file."""

import json
import math

import pytest

torch = pytest.importorskip("torch")

from pipeloom import ConfigError, build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig, build_stages, synthetic_batch  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.lr_schedule import LRSchedule, build_scheduler  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec, reference_training  # noqa: E402

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def held_out(rows, index):
    return synthetic_batch(CONFIG, rows, 97, index)


def closed_form(kind: str, warmup: int, lr: float, floor: float, steps: int, n: int) -> float:
    if n < warmup:
        return lr * (n + 1) / (warmup + 1)
    if kind == "constant":
        return lr
    t = (n - warmup) / max(1, steps - 1 - warmup)
    return floor + (lr - floor) * ((1 - t) if kind == "linear" else (1 + math.cos(math.pi * t)) / 2)


@pytest.mark.parametrize("kind, warmup", [("cosine", 1), ("linear", 2), ("constant", 2)])
def test_learning_rate_follows_torch_schedulers_and_the_pipeline_trains_like_one_process(kind, warmup):
    steps, lr, floor = 5, 2e-3, 1e-4
    spec = TrainSpec(
        build_schedule("zb-v", 2, 4),
        config=CONFIG,
        steps=steps,
        lr=lr,
        lr_schedule=kind,
        warmup_steps=warmup,
        min_lr=floor,
    )
    results = run_in_process(spec)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    scheduler = build_scheduler(optimizer, LRSchedule(kind, warmup, floor), steps)
    expected = []
    for _ in range(steps):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    for result in results:
        assert result.learning_rates == expected
    assert expected == pytest.approx([closed_form(kind, warmup, lr, floor, steps, n) for n in range(steps)], rel=1e-12)
    losses, _ = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)


def test_schedule_settings_are_checked():
    schedule = build_schedule("1f1b", 2, 2)
    for changes, message in (
        ({"lr_schedule": "step"}, "--lr-schedule must be one of"),
        ({"lr_schedule": "cosine", "warmup_steps": 3}, "leaves no step"),
        ({"min_lr": 1.0}, "--min-lr must lie in"),
        ({"lr": -0.01}, "learning rate must be a positive finite number"),  # not blamed on min_lr
        ({"lr": float("inf")}, "learning rate must be a positive finite number"),
        ({"lr": float("nan")}, "learning rate must be a positive finite number"),
        ({"clip_norm": float("nan")}, "clipping norm must be positive"),
        ({"lr_schedule": "linear", "post_validation": True}, "post-validation"),
        ({"eval_every": 1}, "--eval-data"),
    ):
        with pytest.raises(ConfigError, match=message):
            check_spec(TrainSpec(schedule, config=CONFIG, steps=3, **changes))
    with pytest.raises(ConfigError, match="steps must be an integer of at least 1, got 0"):  # trained nothing
        check_spec(TrainSpec(schedule, config=CONFIG, steps=0))
    from pipeloom.data import open_tokens

    held_out = open_tokens("examples/val.bin", CONFIG.seq_len, seed=0)  # the source, not its batch function
    with pytest.raises(ConfigError, match=r"eval_data must be a batch function, .* got a TokenFile"):
        check_spec(TrainSpec(schedule, config=CONFIG, steps=3, eval_data=held_out, eval_every=1))


@pytest.mark.parametrize("name, chunks", [("1f1b", None), ("zb-v", None), ("interleaved", 2), ("chimera", None)])
def test_evaluation_equals_a_single_process_forward(name, chunks):
    schedule = build_schedule(name, 2, 4, **({"num_chunks": chunks} if chunks else {}))
    spec = TrainSpec(schedule, config=CONFIG, steps=2, dp=2, eval_data=held_out, eval_every=2, eval_batches=2)
    results = run_in_process(spec)
    stages = build_stages(CONFIG, schedule.num_stages, 0)
    for stage, module in enumerate(stages):  # the weights after the run, from the rank holding each stage
        trained = next(r.parameters[stage] for r in results if stage in r.parameters)
        module.load_state_dict(trained)
    total = 0.0
    with torch.no_grad():
        for index in range(2):
            inputs, targets = held_out(2 * 4 * CONFIG.microbatch_size, index)
            for j in range(8):  # the mean over every micro-batch of every replica
                rows = slice(j * CONFIG.microbatch_size, (j + 1) * CONFIG.microbatch_size)
                x = inputs[rows]
                for module in stages:
                    x = module(x)
                total += float(
                    torch.nn.functional.cross_entropy(x.reshape(-1, CONFIG.vocab), targets[rows].reshape(-1))
                )
    expected = total / (2 * 8)
    for result in results:
        assert result.eval_losses == [(2, pytest.approx(expected, rel=1e-5))]
    assert results[0].losses == pytest.approx(reference_training(spec)[0], rel=1e-5)  # evaluating trains nothing


def test_metrics_log_writes_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    spec = TrainSpec(
        build_schedule("zb-v", 2, 2),
        config=CONFIG,
        steps=3,
        lr_schedule="cosine",
        warmup_steps=1,
        eval_data=held_out,
        eval_every=3,
        eval_batches=1,
        log_dir=str(tmp_path),
        run_config={"schedule": "zb-v", "steps": 3},
    )
    results = run_in_process(spec)
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0] == {"config": {"schedule": "zb-v", "steps": 3}}
    steps = [line for line in lines[1:] if "loss" in line]
    assert [line["step"] for line in steps] == [1, 2, 3]
    assert [line["loss"] for line in steps] == results[0].losses
    assert [line["lr"] for line in steps] == results[0].learning_rates
    assert all(line["tokens_per_second"] > 0 and line["peak_stash_bytes"] > 0 for line in steps)
    evaluation = [line for line in lines if "eval_loss" in line]
    assert evaluation == [
        {
            "step": 3,
            "eval_loss": results[0].eval_losses[0][1],
            "eval_perplexity": math.exp(results[0].eval_losses[0][1]),
        }
    ]
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(results[0].losses)
    assert [e.step for e in events.Scalars("eval/loss")] == [3]


def test_a_run_from_a_toml_file_equals_the_same_run_from_flags(tmp_path):
    from pipeloom.cli import build_parser, subcommand
    from pipeloom.cli.config_file import expand_config
    from pipeloom.cli.train import train_spec_from_args

    (tmp_path / "run.toml").write_text(
        'schedule = "zb-h1"\ndevices = 2\nnproc = 2\nmicrobatches = 4\nsteps = 3\nlr_schedule = "linear"\n'
        "warmup-steps = 1\nlayers = 4\nhidden = 32\nheads = 2\nffn = 64\nvocab = 64\nseq_len = 16\nsteps_unused = 1\n"
    )
    parser = build_parser()
    train = subcommand(parser, "train")
    with pytest.raises(ConfigError, match="sets 'steps_unused', which is not a flag"):
        expand_config(["train", "--config", str(tmp_path / "run.toml")], train, 1)
    text = (tmp_path / "run.toml").read_text().replace("steps_unused = 1\n", "")
    (tmp_path / "run.toml").write_text(text)
    from_file = parser.parse_args(
        expand_config(["train", "--config", str(tmp_path / "run.toml"), "--steps", "2"], train, 1)
    )
    flags = "train --schedule zb-h1 -p 2 --nproc 2 -m 4 --steps 2 --lr-schedule linear --warmup-steps 1 --layers 4 "
    flags += "--hidden 32 --heads 2 --ffn 64 --vocab 64 --seq-len 16"
    from_flags = parser.parse_args(flags.split())
    assert from_file.steps == 2  # the command line wins
    specs = [train_spec_from_args(args) for args in (from_file, from_flags)]
    runs = [run_in_process(spec) for spec in specs]
    assert runs[0][0].losses == runs[1][0].losses
    assert runs[0][0].learning_rates == runs[1][0].learning_rates
    config = specs[0].run_config
    assert config["config"].endswith("run.toml") and config["lr-schedule"] == "linear" and config["schedule"] == "zb-h1"
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        expand_config(["train", "--config", str(bad)], train, 1)


def test_a_spec_is_its_parts_built_from_parts_or_flat_keywords():
    from dataclasses import replace

    from pipeloom.runtime.spec import OptimizerPart, ParallelPart

    schedule = build_schedule("1f1b", 2, 4)
    flat = TrainSpec(schedule, dp=2, lr=0.1, save_dir="ck", eval_every=3, steps=5)
    parts = TrainSpec(
        parallelism=ParallelPart(schedule=schedule, dp=2),
        optimizer=OptimizerPart(lr=0.1),
        save_dir="ck",
        eval_every=3,
        steps=5,
    )
    assert flat == parts and flat.parallelism.dp == flat.dp == 2 and flat.checkpoints.directory == "ck"
    assert flat.evaluation.every == 3 and flat.optimizer.lr == 0.1 and flat.schedule is schedule
    moved = replace(flat, tp=2, schedule=build_schedule("zb-h1", 2, 4))  # one field of a part changes
    assert (moved.tp, moved.dp, moved.schedule.name, moved.save_dir) == (2, 2, "zb-h1", "ck")
    assert TrainSpec(schedule, optimizer=OptimizerPart(lr=0.1), lr=0.2).lr == 0.2  # a flat keyword wins
    with pytest.raises(TypeError, match="unexpected keyword"):
        TrainSpec(schedule, learning_rate=0.1)


def test_a_toml_file_by_parts_is_the_same_run_as_a_flat_one(tmp_path):
    """The tables are TrainSpec's parts; a flag in another part's table is refused, naming its part."""
    from pipeloom.cli import build_parser, subcommand
    from pipeloom.cli.config_file import expand_config
    from pipeloom.cli.train import train_spec_from_args

    flat = 'schedule = "zb-h1"\ndevices = 2\nmicrobatches = 4\nsteps = 3\nlr = 0.01\nwarmup_steps = 1\n'
    flat += 'lr_schedule = "linear"\nlayers = 4\nhidden = 32\nheads = 2\nffn = 64\nvocab = 64\nseq_len = 16\n'
    flat += "clip_norm = 0.5\nsave_every = 2\n"
    parts = 'steps = 3\n[parallelism]\nschedule = "zb-h1"\ndevices = 2\nmicrobatches = 4\n'
    parts += '[optimizer]\nlr = 0.01\nwarmup_steps = 1\nlr_schedule = "linear"\nclip_norm = 0.5\n'
    parts += "[model]\nlayers = 4\nhidden = 32\nheads = 2\nffn = 64\nvocab = 64\nseq_len = 16\n"
    parts += "[checkpoints]\nsave_every = 2\n"
    parser = build_parser()
    train = subcommand(parser, "train")
    specs = []
    for name, text in (("flat", flat), ("parts", parts)):
        (tmp_path / f"{name}.toml").write_text(text)
        argv = expand_config(["train", "--config", str(tmp_path / f"{name}.toml"), "--save", str(tmp_path)], train, 1)
        spec = train_spec_from_args(parser.parse_args(argv))
        specs.append(spec.changed(run_config=None))
    assert specs[0] == specs[1]
    assert specs[1].optimizer.clip_norm == 0.5 and specs[1].checkpoints.every == 2 and specs[1].steps == 3
    (tmp_path / "misplaced.toml").write_text("[optimizer]\ndp = 2\n")
    with pytest.raises(ConfigError, match=r"sets 'dp' in \[optimizer\]; it belongs under \[parallelism\]"):
        expand_config(["train", "--config", str(tmp_path / "misplaced.toml")], train, 1)
    (tmp_path / "table.toml").write_text("[training]\nsteps = 2\n")
    with pytest.raises(ConfigError, match=r"has a table \[training\]; the parts of a run are \[model\]"):
        expand_config(["train", "--config", str(tmp_path / "table.toml")], train, 1)


def test_a_second_config_file_applies_after_the_first(tmp_path):
    """A second --config was ignored while the header named it: each applies, the later winning,
    the command line over both, and the header names both."""
    from pipeloom.cli import build_parser, subcommand
    from pipeloom.cli.config_file import config_line, expand_config
    from pipeloom.cli.train_args import check_train_flags

    (tmp_path / "base.toml").write_text('schedule = "zb-h1"\ndevices = 2\nlr = 0.01\nsteps = 5\nseed = 3\n')
    (tmp_path / "tweak.toml").write_text("[optimizer]\nlr = 0.02\nmin_lr = 0.001\n")
    parser = build_parser()
    train = subcommand(parser, "train")
    given = ["train", "--config", str(tmp_path / "base.toml"), "--config", str(tmp_path / "tweak.toml"), "--seed", "4"]
    args = parser.parse_args(expand_config(given, train, 1))
    check_train_flags(args)
    assert (args.schedule_flag, args.lr, args.min_lr, args.steps, args.seed) == ("zb-h1", 0.02, 0.001, 5, 4)
    line = config_line(args, train)
    assert f"config={[str(tmp_path / 'base.toml'), str(tmp_path / 'tweak.toml')]}" in line and "lr=0.02 " in line


def test_wandb_is_used_only_when_installed(tmp_path):
    import importlib.util

    spec = TrainSpec(build_schedule("1f1b", 2, 2), config=CONFIG, steps=1, log_dir=str(tmp_path), wandb="pipeloom")
    if importlib.util.find_spec("wandb") is None:
        with pytest.raises(ConfigError, match="--wandb needs Weights & Biases: pip install wandb"):
            run_in_process(spec)
    else:  # offline: nothing leaves the machine
        run_in_process(spec)
        assert any((tmp_path / "wandb").iterdir())
