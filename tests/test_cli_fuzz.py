"""Fuzz of the CLI: each random configuration either is refused in one line with exit status 2,
or is accepted and does what it says. No other outcome — no traceback, no silent breach.

`pipeloom simulate` over every generator and flag: an accepted configuration's exported schedule
is valid and its peak activation memory within --mem-limit. Costs reach M_W up to 2·M_B; a fifth
of the configurations read a schedule file whose rows fuse random neighbours into overlapped
pairs, forward-first or backward-first. PIPELOOM_FUZZ=N runs N configurations instead of 80.

`pipeloom train` and `pipeloom export` over their flags — schedules, layouts, the optimizer,
checkpoints (a real one, and torn, truncated and edited copies of it), resume, logs,
evaluation, config files, data and models: a refused one creates no --save or --log-dir; an
accepted train reaches the launcher (`run_local`, stopped there: ranks are tested elsewhere), an
accepted export writes a model directory. PIPELOOM_FUZZ_TRAIN=N runs N instead of 50.

Seeded, so a failure reproduces; PIPELOOM_FUZZ_SEED=S runs another seed."""

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from pipeloom import build_schedule
from pipeloom.cli import main
from pipeloom.ir.io import load_schedule
from pipeloom.ir.torch_csv import to_torch_csv
from pipeloom.schedules import list_generators

CASES = int(os.environ.get("PIPELOOM_FUZZ", "80"))
TRAIN_CASES = int(os.environ.get("PIPELOOM_FUZZ_TRAIN", "50"))
SEED = int(os.environ.get("PIPELOOM_FUZZ_SEED", "20261123"))
ROOT = Path(__file__).resolve().parent.parent
_PAIRABLE = re.compile(r"^\d+[FIB]\d+$")


def random_configuration(rng: random.Random, directory: Path) -> list[str]:
    generator = rng.choice(list_generators())
    options = generator.options
    p, m = rng.randint(1, 9), rng.randint(1, 20)
    argv = ["simulate", generator.name, "-p", str(p), "-m", str(m)]
    if "num_chunks" in options and rng.random() < 0.7:
        argv += ["-v", str(rng.randint(1, 4))]
    if "num_slices" in options and rng.random() < 0.7:
        argv += ["--slices", str(rng.choice([1, 2, 4]))]
    if rng.random() < 0.2:
        argv = ["simulate", "--schedule-file", _paired_schedule_file(rng, directory)]
        options = ("mem_limit",)  # taken with --ckpt mario or its passes, refused in one line without
        if rng.random() < 0.3:
            argv += ["--passes", rng.choice(["apply-checkpoint,relax-checkpoint", "relax-checkpoint"])]
    costs = {key: round(rng.uniform(0.05, 5), 3) for key in ("F", "B", "W")}
    costs.update(comm=rng.choice([0, 0, 0.5, 1.3]), M_B=round(rng.uniform(0.5, 3), 3))
    costs.update(M_W=round(rng.uniform(0, 2 * costs["M_B"]), 3), R=round(rng.uniform(0.1, 3), 3))
    if rng.random() < 0.3:
        costs.update(a2a_F=round(rng.uniform(0, 1), 3), a2a_B=round(rng.uniform(0, 1), 3))
    if rng.random() < 0.3:
        costs["M_static"] = round(rng.uniform(0, 5), 3)
    if rng.random() < 0.2:
        costs["recompute_fraction"] = round(rng.uniform(0.05, 1), 3)
    flag = rng.random()
    if 0.5 <= flag < 0.55:  # T-Offload's lanes: bytes, rates, a host link shared with p2p or not
        costs.update(offload_bytes=round(rng.uniform(0, 8), 3), reload_bytes=round(rng.uniform(0, 8), 3))
        costs.update(host_bandwidth=round(rng.uniform(0.5, 4), 3), p2p_host_link_share=rng.choice([0, 0.5, 1]))
    argv += ["--costs", ",".join(f"{key}={value}" for key, value in costs.items())]
    if "mem_limit" in options and rng.random() < 0.6:
        limits = [round(rng.uniform(0.5, 4) * costs["M_B"] * p, 3) for _ in range(p)]
        argv += ["--mem-limit", str(limits[0]) if rng.random() < 0.5 else ",".join(map(str, limits))]
    if flag < 0.15:
        argv += ["--split", rng.choice(["after", "deferred", "fill"])]
    elif flag < 0.3:
        argv += ["--weight-parts", str(rng.randint(1, 4))]
    elif flag < 0.4:
        argv += ["--ckpt", rng.choice(["full", "mario"])]
    elif flag < 0.5:
        argv += ["--recompute", rng.choice(["shallow", "0", "1", "0,1"])]
    elif flag < 0.55:
        argv += ["--offload"]
    return argv


def _paired_schedule_file(rng: random.Random, directory: Path) -> str:
    """A generated schedule in torch's CSV with random neighbouring compute actions fused into
    overlapped pairs in whichever order they stood: some valid, some deadlocked or malformed."""
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved", "dualpipev"])
    p = rng.randint(1, 4)
    m = rng.randint(max(1, 2 * p - 1) if name == "dualpipev" else 1, 3 * p + 2)
    if name == "interleaved" and m > p:
        m -= m % p
    rows = []
    for row in to_torch_csv(build_schedule(name, p, m)).splitlines():
        cells, out, i = row.split(","), [], 0
        while i < len(cells):
            pair = cells[i : i + 2]
            if len(pair) == 2 and all(_PAIRABLE.match(c) for c in pair) and rng.random() < 0.3:
                out.append(f"({pair[0]};{pair[1]})OVERLAP_F_B")
                i += 2
            else:
                out.append(cells[i])
                i += 1
        rows.append(",".join(out))
    path = directory / f"paired-{rng.randrange(10**9)}.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _limits(argv: list[str], p: int) -> list[float] | None:
    if "--mem-limit" not in argv:
        return None
    values = [float(x) for x in argv[argv.index("--mem-limit") + 1].split(",")]
    return values * p if len(values) == 1 else values


def test_every_configuration_is_refused_in_one_line_or_valid_and_within_budget(capsys, tmp_path):
    rng = random.Random(SEED)
    accepted = refused = 0
    for case in range(CASES):
        argv = random_configuration(rng, tmp_path)
        export = tmp_path / "schedule.json"
        export.unlink(missing_ok=True)
        code = main([*argv, "--json", "--export", str(export)])
        out, err = capsys.readouterr()
        if code == 2:
            refused += 1
            assert len(err.strip().splitlines()) == 1 and out == "" and not export.exists(), (case, argv, err)
            continue
        assert code == 0, (case, argv, err)
        accepted += 1
        schedule = load_schedule(export)  # validated on load
        facts = json.loads(out)
        limits = _limits(argv, schedule.num_devices)
        if limits is not None:
            for peak, limit in zip(facts["peak_activation_memory"], limits):
                assert peak <= limit + 1e-9 * max(1.0, limit), (case, argv, peak, limit)
    print(f"fuzz: {CASES} configurations, {accepted} accepted (valid, within budget), {refused} refused in one line")
    assert accepted > CASES / 4 and refused > 0  # the generator reaches both outcomes


@pytest.mark.parametrize("seed", [1, 2])
def test_the_fuzz_configurations_are_reproducible(seed, tmp_path):
    first, second = (random_configuration(random.Random(seed), tmp_path) for _ in range(2))
    assert first == second


class _Launched(BaseException):
    """The configuration reached the launcher: accepted (a BaseException, which no handler of
    the CLI catches)."""


@dataclass
class World:
    """What the configurations draw from: models, data, config files, a real checkpoint and
    broken copies of it, a directory holding another run's files."""

    root: Path

    def path(self, rng: random.Random, *choices: str) -> str:
        return str(self.root / rng.choice(choices))


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from helpers.hf_configs import TINY

    from pipeloom.data import write_token_file

    root = tmp_path_factory.mktemp("fuzz")
    for name in ("llama", "qwen2"):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(TINY[name]))
    mixtral = {"model_type": "mixtral", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}
    mixtral |= {"intermediate_size": 64, "vocab_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
    (root / "bad-heads").mkdir()
    (root / "bad-heads" / "config.json").write_text(json.dumps(mixtral))  # Mixtral's default: 8 K/V heads
    mixtral["num_key_value_heads"] = 2
    (root / "mixtral").mkdir()
    (root / "mixtral" / "config.json").write_text(json.dumps(mixtral))
    (root / "broken").mkdir()
    (root / "broken" / "config.json").write_text('{"model_type": "llama", "hidden_size": ')
    write_token_file(root / "tokens.bin", [i % 90 for i in range(3000)])
    write_token_file(root / "five.bin", [1, 2, 3, 4, 5])
    (root / "afile").write_text("not a directory")
    (root / "good.toml").write_text('schedule = "1f1b"\ndevices = 2\nmicrobatches = 2\n[optimizer]\nlr = 0.002\n')
    (root / "lr.toml").write_text('[optimizer]\nlr_schedule = "cosine"\nwarmup_steps = 1\nmin_lr = 0.0001\n')
    (root / "bad.toml").write_text("schedule = \n")
    (root / "unknown.toml").write_text("learning_rate = 0.1\n")
    (root / "misplaced.toml").write_text("[optimizer]\ndp = 2\n")
    example = (ROOT / "examples" / "run.toml").read_text()  # its inputs where they are; its outputs here
    example = example.replace('"hf:examples/', f'"hf:{ROOT}/examples/').replace('"examples/', f'"{ROOT}/examples/')
    (root / "example.toml").write_text(example.replace('save = "ck"', 'save = "example-ck"'))
    # a real checkpoint: the tiny LLaMA on 2 ranks, a cosine run of 4 steps, saved at 2 and 4
    argv = ["train", "1f1b", "-p", "2", "-m", "2", "--nproc", "2", "--model", f"hf:{root / 'llama'}"]
    argv += ["--seq-len", "16", "--steps", "4", "--lr-schedule", "cosine"]
    assert main([*argv, "--save", str(root / "ck"), "--save-every", "2", "--quiet"]) == 0
    shutil.copytree(root / "ck", root / "other")  # another run's directory, for --save, --log-dir, --output
    # a plan of the built-in decoder from a synthetic profile, and two broken copies
    from tune.test_profiled import MODEL, profile

    (root / "prof.json").write_text(json.dumps(profile() | {"model": {**MODEL, "layers": 4}}))
    tune = ["tune", "--costs", str(root / "prof.json"), "--devices", "2", "--memory", "1GiB", "--global-batch", "8"]
    assert main([*tune, "--schemes", "1f1b,zb-h1,zb-v", "--runnable", "--output", str(root / "plan.json")]) == 0
    text = (root / "plan.json").read_text()
    (root / "bad-plan.json").write_text(text[: len(text) // 2])
    (root / "edited-plan.json").write_text(json.dumps(json.loads(text) | {"pp": 3}))
    for name, damage in (("torn", _tear), ("truncated", _truncate), ("edited", _edit_model), ("marker", _edit_marker)):
        shutil.copytree(root / "ck", root / name)
        damage(root / name / "step-4")
    return World(root)


def _tear(step: Path) -> None:
    (step / "COMPLETE").unlink()


def _truncate(step: Path) -> None:
    shard = max(step.glob("*.distcp"), key=lambda path: path.stat().st_size)
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 3])


def _edit_model(step: Path) -> None:
    model = json.loads((step / "model.json").read_text())
    model["config"]["hidden_size"] = 48  # shapes the weights do not have
    (step / "model.json").write_text(json.dumps(model))


def _edit_marker(step: Path) -> None:
    marker = json.loads((step / "COMPLETE").read_text())
    marker["lr_curve"] = {"lr": "fast", "kind": "cosine"}
    (step / "COMPLETE").write_text(json.dumps(marker))


class Draw:
    """Random flag values: a good one, or now and then (`wild` of the time) a bad one."""

    def __init__(self, rng: random.Random, wild: float):
        self.rng, self.wild = rng, wild

    def __call__(self, good: list, bad: list) -> str:
        return str(self.rng.choice(bad) if self.rng.random() < self.wild else self.rng.choice(good))


_PAIRED = {"--sequence-parallel": "--tp", "--lr-restart": "--resume", "--allow-input-change": "--resume",
           "--eval-every": "--eval-data", "--wandb": "--log-dir", "--recompute-layers": "--ckpt"}  # fmt: skip
"""A flag and the one it applies to: a careful configuration gives both or neither."""


def random_train(rng: random.Random, world: World, case: int) -> list[str]:
    """A careful configuration (flags that go together, a bad value now and then) three times in
    four, a careless one (any flags, bad values often) otherwise."""
    careful = rng.random() < 0.75
    draw = Draw(rng, 0.04 if careful else 0.3)
    if rng.random() < 0.1:  # a tuned plan fixes the schedule, the model and dp
        plan = world.path(rng, "plan.json", "plan.json", "bad-plan.json", "edited-plan.json")
        argv = ["train", "--plan", plan] + ([] if careful else ["-p", "2"])
        argv += ["--nproc", draw(["2"], ["3"])] if rng.random() < 0.5 else []
    else:
        argv = _schedule_and_model(rng, world, careful, draw)
    return _with_run_flags(argv, rng, world, case, careful, draw, tp="--tp" in argv)


def _schedule_and_model(rng: random.Random, world: World, careful: bool, draw: Draw) -> list[str]:
    generators = {generator.name: generator for generator in list_generators()}
    name = draw(sorted(generators), ["nope"])
    p, m, dp = rng.randint(1, 3), rng.randint(1, 6), rng.choice([1, 1, 2])
    tp = rng.choice([None, None, 1, 2])
    argv = ["train", name, "-p", str(p), "-m", str(m)]
    options = generators[name].options if name in generators else ()
    if rng.random() < 0.3 and ("num_chunks" in options or not careful):
        argv += ["-v", draw([1, 2], [0, -1])]
    if rng.random() < 0.3 and ("num_slices" in options or not careful):
        argv += ["--slices", draw([1, 2, 4], [0, 3])]
    if rng.random() < 0.3:
        argv += ["--dp", draw([dp], [0, -2])]
    else:
        dp = 1
    if tp is not None:
        argv += ["--tp", str(tp)]
    argv += ["--nproc", draw([p * dp * (tp or 1)], [p * dp * (tp or 1) + 1, 0])]
    if rng.random() < 0.4 or tp:
        argv += [
            "--model",
            "hf:" + world.path(rng, *(["llama"] * 6), "qwen2", "mixtral", "bad-heads", "broken", "missing"),
        ]
        argv += ["--seq-len", draw([16, 32], [0, 7, 100000])]
    else:
        for flag, good, bad in (("--layers", [2, 4], [0, -1]), ("--hidden", [32, 64], [0, 30]), ("--heads", [2], [3])):
            if rng.random() < 0.4:
                argv += [flag, draw(good, bad)]
    return argv


def _with_run_flags(argv, rng: random.Random, world: World, case: int, careful: bool, draw: Draw, tp: bool):
    picks = {
        "--ep": lambda: draw([1, 2], [0, 3]),
        "--sequence-parallel": None,
        "--zero": lambda: draw([0, 1, 2], [3, -1]),
        "--offload-stages": lambda: draw(["0", "1", "0,1"], ["5", "a", "-1"]),
        "--dtype": lambda: draw(["fp32", "bf16", "fp16"], ["fp8"]),
        "--clip-norm": lambda: draw([0.5, 1.0], ["nan", -1, 0, "inf"]),
        "--post-validation": None,
        "--lr": lambda: draw([1e-3, 0.05], [-0.01, "nan", "inf", 0]),
        "--lr-schedule": lambda: draw(["constant", "linear", "cosine"], ["step"]),
        "--warmup-steps": lambda: draw([0, 1, 2], [-1, 99]),
        "--min-lr": lambda: draw([0.0, 1e-4], [1.0, "nan", -1]),
        "--lr-restart": None,
        "--steps": lambda: draw([1, 2, 3, 6], [0, -1]),
        "--seed": lambda: draw([0, 7], [-1]),
        "--microbatch-size": lambda: draw([1, 2], [0, -1]),
        "--keep-last": lambda: draw([0, 1], [-1]),
        "--resume": lambda: world.path(rng, "ck", "ck", "ck/step-2", "torn", "marker", "truncated", "missing", "afile"),
        "--allow-input-change": None,
        "--force": None,
        "--eval-data": lambda: world.path(rng, "tokens.bin", "tokens.bin", "five.bin", "missing.bin"),
        "--eval-every": lambda: draw([1, 2], [0, -1]),
        "--eval-batches": lambda: draw([1, 2], [0, 10**9]),
        "--data": lambda: world.path(rng, "tokens.bin", "tokens.bin", "tokens.bin", "five.bin", "missing.bin", "afile"),
        "--config": lambda: world.path(
            rng,
            "good.toml",
            "lr.toml",
            "example.toml",
            "good.toml",
            "lr.toml",
            "bad.toml",
            "unknown.toml",
            "misplaced.toml",
            "missing.toml",
        ),  # fmt: skip
        "--ckpt": lambda: draw(["full", "mario"], ["some"]),
        "--recompute-layers": lambda: draw([1, 2], [0, -1]),
        "--timeout": lambda: draw([60], [0, -1, "nan"]),
        "--device": lambda: draw(["cpu"], ["cuda", "tpu"]),
        "--backend": lambda: draw(["gloo"], ["nccl", "mpi"]),
        "--compile": None,
        "--trace": lambda: str(world.root / f"trace-{case}.json") if rng.random() < 0.9 else world.path(rng, "afile/x"),
        "--wandb": lambda: "project",
    }
    chosen = rng.sample(sorted(picks), rng.randint(0, 6))
    save = rng.random() < 0.35
    logs = rng.random() < 0.2
    if careful:
        given = set(chosen) | ({"--tp"} if tp else set()) | ({"--log-dir"} if logs else set())
        chosen = [flag for flag in chosen if _PAIRED.get(flag, flag) in given]
    for flag in chosen:
        value = picks[flag]
        argv += [flag] if value is None else [flag, value()]
    if save:
        where = draw([f"save-{case}"], ["other", "afile", "afile/ck", "/proc/pipeloom-fuzz"])
        argv += ["--save", where if where.startswith("/") else str(world.root / where)]
        argv += ["--save-every", draw([1, 2], [0, -1])] if careful or rng.random() < 0.8 else []
    if logs:
        where = draw([f"logs-{case}"], ["other", "afile", "/proc/pipeloom-fuzz"])
        argv += ["--log-dir", where if where.startswith("/") else str(world.root / where)]
    return argv


def random_export(rng: random.Random, world: World, case: int) -> list[str]:
    source = world.path(rng, "ck", "ck/step-2", "torn", "truncated", "edited", "marker", "missing", "afile")
    output = rng.choice([f"hf-{case}", f"hf-{case}", "llama", "afile", "other", "ck/step-4/hf"])
    argv = ["export", source, "--output", str(world.root / output)]
    if rng.random() < 0.3:
        argv += ["--dtype", rng.choice(["fp32", "bf16", "fp16"])]
    if rng.random() < 0.3:
        argv += ["--force"]
    return argv


def _fresh_outputs(argv: list[str]) -> list[Path]:
    """The --save and --log-dir this configuration names that did not exist before it."""
    paths = [Path(argv[i + 1]) for i, flag in enumerate(argv[:-1]) if flag in ("--save", "--log-dir")]
    return [path for path in paths if not path.exists()]


def test_every_train_or_export_configuration_is_refused_in_one_line_or_runs(world, capsys, monkeypatch):
    import pipeloom.runtime.local

    def launched(spec, **_):
        raise _Launched

    monkeypatch.setattr(pipeloom.runtime.local, "run_local", launched)
    monkeypatch.chdir(world.root)  # what a configuration names relative to here stays in the world
    rng = random.Random(SEED)
    outcomes = {"refused": 0, "launched": 0, "exported": 0}
    for case in range(TRAIN_CASES):
        exporting = rng.random() < 0.15
        argv = (random_export if exporting else random_train)(rng, world, case)
        fresh = _fresh_outputs(argv)
        try:
            code = main(argv)
        except _Launched:
            outcomes["launched"] += 1
            capsys.readouterr()
            continue
        out, err = capsys.readouterr()
        if code == 2:
            outcomes["refused"] += 1
            assert len(err.strip().splitlines()) == 1 and out == "" and "Traceback" not in err, (case, argv, err)
            assert not any(path.exists() for path in fresh), (case, argv, "a refused run created its outputs")
            continue
        assert code == 0 and exporting, (case, argv, code, err)
        outcomes["exported"] += 1
        assert {"config.json", "model.safetensors"} <= {p.name for p in Path(argv[3]).iterdir()}, (case, argv)
    print(f"fuzz: {TRAIN_CASES} train/export configurations: {outcomes}")
    assert outcomes["refused"] and outcomes["launched"] and (outcomes["exported"] or TRAIN_CASES < 50)
