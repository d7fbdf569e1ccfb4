"""Issue 16's regressions: bad input gets one line on stderr, exit status 2, and nothing written;
passes after a budgeted generator keep its budget."""

import json
import subprocess
import sys

import pytest

from pipeloom.cli import main

# The fuzz found this at p=11, v=4 (15 s of SVPP's search); the same costs and budget break the
# same way at p=5, v=2 in a second.
SVPP = ["simulate", "svpp", "-p", "5", "-m", "8", "-v", "2", "--slices", "4", "--mem-limit", "12.681"]
SVPP_COSTS = ["--costs", "F=1.075,B=4.974,W=4.649,comm=1.062,M_B=2.689,M_W=1.077,attention_fraction=0.346"]
BUDGETS = "18.145,34.122,34.1,14.224,31.566,32.024,4.002,4.515,26.031,10.13,13.33"
ZB_COSTS = "F=0.161,B=0.397,W=3.393,comm=1.355,R=2.631,M_B=1.559,M_W=1.393,M_ckpt=0.61"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*SVPP, "--split", "deferred", *SVPP_COSTS], "device 0 peaks at 15.13 of activation memory, 2.449 over"),
        ([*SVPP, "--split", "fill", *SVPP_COSTS], "over its limit 12.681"),
        (["simulate", "1f1b", "-p", "4", "-m", "100000000"], "about 2,400,000,000 ops"),
        (["simulate", "1f1b", "-p", "4", "-m", "4", "--costs", "F=1e308,B=1e308", "--json"], "the costs overflow"),
        (["compare", "1f1b", "gpipe", "-p", "4", "-m", "4", "--costs", "F=1e308,B=1e308"], "the costs overflow"),
        (["simulate", "zb-auto", "-p", "4", "-m", "8", "--mem-limit", "40GiB", "--costs", "F=1,B=1"], "unit-less"),
        (["simulate", "1f1b", "-p", "4", "-m", "4", "--costs", "F=0,B=0"], "no work"),
        (  # a plan train would refuse
            ["tune", "--model", "gpt3-1.6b", "--hardware", "a100-40g", "--devices", "8", "--global-batch", "32"]
            + ["--schemes", "1f1b", "--tp", "1", "--sequence-parallel"],
            "--sequence-parallel shards the sequence over a tensor-parallel group: add --tp N",
        ),
        (  # the plan train would refuse: it cannot cut 8 K/V heads over 16 ranks
            ["tune", "--model", "llama2-34b", "--hardware", "a100-40g", "--devices", "16", "--global-batch", "32"]
            + ["--schemes", "1f1b", "--tp", "16"],
            "--tp 16: llama2-34b's 8 key/value heads do not divide by 16",
        ),
        (  # runnable: pipeloom's runtime splits the vocabulary unpadded
            ["tune", "--model", "gpt3-1.6b", "--hardware", "a100-40g", "--devices", "8", "--global-batch", "32"]
            + ["--schemes", "1f1b", "--tp", "2", "--runnable"],
            "--tp 2: gpt3-1.6b's 50257 vocabulary entries do not divide by 2",
        ),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, argv, message):
    export = tmp_path / "out.json"
    extra = {"simulate": ["--export", str(export)], "tune": ["--output", str(export)]}.get(argv[0], [])
    code = main([*argv, *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not export.exists()
    assert len(err.strip().splitlines()) == 1 and message in err


def test_weight_parts_keep_each_devices_budget(capsys):
    argv = ["simulate", "zb-auto", "-p", "11", "-m", "18", "--weight-parts", "1", "--mem-limit", BUDGETS]
    assert main([*argv, "--costs", ZB_COSTS, "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)["peak_activation_memory"]
    assert all(peak <= limit + 1e-9 for peak, limit in zip(peaks, map(float, BUDGETS.split(","))))


def test_recomputing_the_deepest_tpipe_chunk_runs(capsys):
    assert main(["simulate", "tpipe", "-p", "3", "-m", "2", "-v", "2", "--recompute", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] > 0


BAD_TRAIN_FLAGS = [
    (["--steps", "0"], "--steps must be at least 1"),
    (["--save", "ckpt"], "--save DIR and --save-every K go together"),
    (["--clip-norm", "-1"], "--clip-norm must be positive"),
    (["--clip-norm", "nan"], "--clip-norm must be positive"),
    (["--lr=-0.01"], "--lr must be a positive finite number, got -0.01"),  # not blamed on --min-lr
    (["--lr", "nan"], "--lr must be a positive finite number, got nan"),
    (["--lr", "inf"], "--lr must be a positive finite number, got inf"),  # trained to NaN and exited 0
    (["--summary", "/nonexistent/dir/s.json"], "does not exist"),
    (["--log-dir", "/proc/pipeloom-logs"], "cannot make a directory in '/proc'"),  # a rank's traceback
    (["--seed=-1"], "--seed must lie in [0, 2**32), got -1"),  # numpy's traceback in the first batch
    (["--seq-len", "0"], "--seq-len must be at least 1, got 0"),  # a reshape's traceback in the probe
]


def test_train_refuses_bad_flags_before_importing_torch():
    """Each refusal in a fresh interpreter (one for all of them: none imports torch, so each
    call starts where a fresh one would): exit 2, one line, torch never imported."""
    code = (
        "import contextlib, io, json, sys; from pipeloom.cli import main\n"
        f"for flags in {[flags for flags, _ in BAD_TRAIN_FLAGS]!r}:\n"
        "    err = io.StringIO()\n"
        "    with contextlib.redirect_stderr(err):\n"
        "        code = main(['train', '--nproc', '2', '--schedule', '1f1b', '-p', '2', '-m', '2', *flags])\n"
        "    print(json.dumps([code, 'torch' in sys.modules, err.getvalue()]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    outcomes = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(outcomes) == len(BAD_TRAIN_FLAGS), done.stderr
    for (flags, message), (code, imported_torch, err) in zip(BAD_TRAIN_FLAGS, outcomes):
        assert (code, imported_torch) == (2, False), flags
        assert len(err.strip().splitlines()) == 1 and message in err, (flags, err)


def test_a_plan_that_does_not_hold_together_is_refused_naming_the_field(capsys, tmp_path):
    argv = ["tune", "--model", "zb-1.5b", "--hardware", "rtx-4090", "--devices", "4", "--global-batch", "8"]
    plan = tmp_path / "plan.json"
    assert main([*argv, "--schemes", "1f1b", "--max-mbs", "1", "--output", str(plan)]) == 0
    capsys.readouterr()
    data = json.loads(plan.read_text())
    for changes, message in [
        ({"pp": data["pp"] + 1}, "field 'pp'"),
        ({"schedule": None}, "lacks the field 'schedule'"),
        ({"scheme": "gpipe"}, "field 'scheme' is 'gpipe', but its schedule was built by '1f1b'"),
        ({"scheme": "pipedream"}, "field 'scheme' is 'pipedream', not one of"),
        (
            {"tp": 2, "devices": 2 * data["devices"]},
            "field 'tp' is 2, but its costs and predictions were made for tp = 1",
        ),
        ({"inputs": {"data": {"kind": "csv"}}}, "field 'inputs.data' is not a data record"),
        ({"inputs": {"dtype": "int8"}}, "field 'inputs.dtype' must be one of fp32, bf16, fp16"),
        ({"inputs": {"device": "tpu"}}, "field 'inputs.device' must be one of cpu, cuda, got 'tpu'"),
        ({"inputs": {"threads": 0}}, "field 'inputs.threads' must be a positive integer, got 0"),
        ({"inputs": {"threads": 2.5}}, "field 'inputs.threads' must be a positive integer, got 2.5"),
    ]:
        broken = {k: v for k, v in {**data, **changes}.items() if v is not None}
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        assert main(["train", "--plan", str(tmp_path / "bad.json")]) == 2
        _, err = capsys.readouterr()
        assert len(err.strip().splitlines()) == 1 and message in err


def test_tune_without_matplotlib_writes_the_plan_and_skips_only_the_default_plot(capsys, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as after `pip install pipeloom` without extras
    argv = ["tune", "--model", "zb-1.5b", "--hardware", "rtx-4090", "--devices", "4", "--global-batch", "8"]
    argv += ["--schemes", "1f1b", "--max-mbs", "1", "--output", str(tmp_path / "plan.json")]
    assert main(argv) == 0
    assert "no timeline (matplotlib is not installed" in capsys.readouterr().out
    assert (tmp_path / "plan.json").exists() and not (tmp_path / "plan.png").exists()
    assert main([*argv, "--plot", str(tmp_path / "asked.png")]) == 2  # asked for: refused before the search
    assert "needs matplotlib" in capsys.readouterr().err and not (tmp_path / "asked.png").exists()


def test_marios_passes_run_one_by_one_from_the_command_line(capsys):
    base = ["simulate", "1f1b", "-p", "4", "-m", "8", "--json"]
    assert main([*base, "--passes", "apply-checkpoint"]) == 0
    checkpointed = json.loads(capsys.readouterr().out)
    assert main([*base, "--passes", "apply-checkpoint,overlap-recompute,remove-redundancy,prepose-forward"]) == 0
    tessellated = json.loads(capsys.readouterr().out)
    assert tessellated["name"] == "1f1b+ckpt+overlap+dedup+prepose"
    assert tessellated["makespan"] < checkpointed["makespan"]  # the recomputes moved into bubbles
    assert main([*base, "--passes", "apply-checkpoint,relax-checkpoint", "--mem-limit", "3"]) == 0
    relaxed = json.loads(capsys.readouterr().out)
    assert max(relaxed["peak_activation_memory"]) <= 3 and relaxed["makespan"] < checkpointed["makespan"]
    assert main([*base, "--passes", "apply-checkpoint,bogus"]) == 2
    assert "unknown pass 'bogus'" in capsys.readouterr().err


def test_data_records_compare_contents_not_paths(tmp_path, monkeypatch):
    """A resume or a plan compares what the data is: a moved corpus is the same data, a rewritten
    or appended one is not; a large file's sampled fingerprint still sees truncation and appends."""
    from pipeloom import provenance

    first = tmp_path / "a.bin"
    first.write_bytes(bytes(range(256)) * 8)
    record = provenance.token_file(first, "uint16")
    moved = tmp_path / "moved.bin"
    first.rename(moved)
    assert provenance.differences(record, provenance.token_file(moved, "uint16")) == []
    moved.write_bytes(bytes(range(256)) * 7 + bytes(256))  # same size, other ids
    (change,) = provenance.differences(record, provenance.token_file(moved, "uint16"))
    assert f"token file {str(first.resolve())!r} (uint16, 2.0 KiB), not token file {str(moved.resolve())!r}" in change
    same_place = provenance.token_file(moved, "uint16")
    moved.write_bytes(moved.read_bytes() + bytes(2))
    assert provenance.differences(same_place, provenance.token_file(moved, "uint16")) == [
        f"token file {str(moved.resolve())!r} (uint16, 2.0 KiB) as it was (its bytes and sha256 changed since)"
    ]
    assert provenance.differences(None, same_place) == []  # older checkpoints record nothing
    monkeypatch.setattr(provenance, "_WHOLE", 64)  # sampled: 64 spaced samples of 8 bytes
    monkeypatch.setattr(provenance, "_SAMPLE", 8)
    sampled = provenance.fingerprint(moved)
    moved.write_bytes(moved.read_bytes()[:-2])
    assert provenance.fingerprint(moved) != sampled


def test_long_planning_work_is_never_silent_off_a_terminal(capsys):
    """`pareto -p 64 -m 512` ran minutes and `show zb-v -p 64 -m 1000` seconds with nothing on a
    piped stderr: counted work prints a line now and then, uncounted work says it is still going."""
    import time

    from pipeloom.cli.output import _progress_lines, still_working

    report = _progress_lines("pareto", "schedule", first_s=0.0, every_s=3600.0)
    for done in range(3):
        report(done, 3)
    assert capsys.readouterr().err.splitlines() == ["pipeloom pareto: 0 of 3 schedules after 0 s"]
    with still_working("building zb-v for p=64, m=1000", after_s=0.01, every_s=3600.0):
        time.sleep(0.2)
    assert capsys.readouterr().err.startswith("pipeloom: building zb-v for p=64, m=1000: still working after 0 s")
    with still_working("quick", after_s=60.0):
        pass
    assert capsys.readouterr().err == ""  # work done in time says nothing, and does not wait


def test_tune_refuses_data_too_short_for_the_model_it_plans(capsys, tmp_path):
    """A 5-token file was recorded in a plan that train then refused: a sequence of the model's
    length (and the next token) must fit."""
    tokens = tmp_path / "five.bin"
    tokens.write_bytes(bytes([1, 0, 2, 0, 3, 0, 4, 0, 5, 0]))  # five uint16 ids
    plan = tmp_path / "plan.json"
    argv = ["tune", "--model", "gpt3-1.6b", "--hardware", "a100-40g", "--devices", "8", "--global-batch", "32"]
    assert main([*argv, "--schemes", "1f1b", "--data", str(tokens), "--output", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("holds 5 tokens, fewer than one sequence of 1024 + 1") and len(err.splitlines()) == 1
    assert not plan.exists()


@pytest.mark.parametrize("router_loss", [True, False])
def test_tune_runnable_plans_no_slices_for_a_model_with_the_router_loss(capsys, tmp_path, router_loss):
    """train refuses slices with the load-balancing loss (it needs whole micro-batches): tune
    --runnable ranked SVPP plans first for such a Mixtral, which train then refused."""
    config = {"model_type": "mixtral", "hidden_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4}
    config |= {"intermediate_size": 64, "vocab_size": 96, "num_local_experts": 4, "num_experts_per_tok": 2}
    (tmp_path / "mixtral.json").write_text(json.dumps({**config, "output_router_logits": router_loss}))
    argv = ["tune", "--model", str(tmp_path / "mixtral.json"), "--hardware", "a100-40g", "--devices", "4"]
    argv += ["--global-batch", "16", "--runnable", "--ep", "2", "--schemes", "svpp,1f1b", "--top", "20"]
    assert main([*argv, "--output", str(tmp_path / "plan.json")]) == 0
    ranked = [line for line in capsys.readouterr().out.splitlines() if line[:3].strip().rstrip(".").isdigit()]
    assert ranked and any("svpp" in line for line in ranked) != router_loss


def test_tune_runnable_ranks_only_plans_train_accepts(capsys, tmp_path):
    """A 30-token sequence does not split into 4 slices, so train refuses an svpp plan with s=4;
    tune --runnable ranked it anyway. Each ranked plan is now checked as `train --plan` checks it,
    and one train refuses is ruled out, saying why."""
    from tune.test_profiled import MODEL, profile

    from pipeloom.runtime.plan_run import spec_from_plan
    from pipeloom.runtime.spec_checks import check_spec
    from pipeloom.tune.plan import Plan

    data = profile() | {"model": {**MODEL, "seq_len": 30, "layers": 4}}
    (tmp_path / "prof.json").write_text(json.dumps(data))
    argv = ["tune", "--costs", str(tmp_path / "prof.json"), "--devices", "2", "--memory", "1GiB"]
    argv += ["--global-batch", "8", "--schemes", "svpp,1f1b", "--top", "20", "--json"]
    for runnable in (False, True):
        output = tmp_path / f"plan-{runnable}.json"
        assert main([*argv, "--output", str(output), *(["--runnable"] if runnable else [])]) == 0
        labels = [row["plan"] for row in json.loads(capsys.readouterr().out)]
        assert any(" s=4" in label for label in labels) != runnable and any(" s=2" in label for label in labels)
    check_spec(spec_from_plan(Plan.load(str(output))), on_this_device=False)  # what train --plan checks

    text = main([*argv[:-1], "--runnable", "--output", str(tmp_path / "plan.json")])
    assert text == 0 and "refused by train" in capsys.readouterr().out
