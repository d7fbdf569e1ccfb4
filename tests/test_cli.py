"""The `pipeloom` command line: outputs, and one-line errors with exit status 2 for bad input."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeloom import build_schedule, load_schedule
from pipeloom.cli import main

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_list_names_every_schedule_with_its_paper(capsys):
    code, out, _ = run(capsys, "list")
    assert code == 0
    for name, paper in [("gpipe", "GPipe"), ("1f1b", "DAPPLE"), ("interleaved", "Megatron"), ("chimera", "Chimera")]:
        assert any(line.startswith(name) and paper in line for line in out.splitlines())
    code, out, _ = run(capsys, "list", "--json")
    assert {entry["name"] for entry in json.loads(out)} >= {"gpipe", "1f1b", "interleaved", "chimera"}


def test_simulate_json(capsys):
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "4", "--costs", "F=1,B=2,W=0,comm=0", "--json")
    assert code == 0
    result = json.loads(out)
    assert result["name"] == "1f1b"
    assert result["makespan"] == 21 and result["cost"] == 21
    assert result["bubble_rate"] == pytest.approx(3 / 7)
    assert result["peak_memory"] == [4, 3, 2, 1]


def test_simulate_table_and_chunks(capsys):
    code, out, _ = run(capsys, "simulate", "interleaved", "-p", "4", "-m", "8", "-v", "2")
    assert code == 0
    assert "makespan     28.5" in out and "bubble rate  15.79%" in out
    assert [line.split()[0] for line in out.splitlines()[-4:]] == ["d0", "d1", "d2", "d3"]


def test_costs_file_and_outputs_round_trip(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"F": [1, 1, 2, 2], "B": 2, "M_static": 1}))
    export, trace, plot = tmp_path / "s.json", tmp_path / "t.json", tmp_path / "t.png"
    code, out, _ = run(
        capsys,
        "simulate",
        "chimera",
        "-p",
        "4",
        "-m",
        "8",
        "--costs",
        str(costs),
        "--json",
        "--export",
        str(export),
        "--trace",
        str(trace),
        "--plot",
        str(plot),
    )
    assert code == 0
    first = json.loads(out)
    assert load_schedule(export) == build_schedule("chimera", 4, 8)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    events = json.loads(trace.read_text())["traceEvents"]
    assert sum(event["ph"] == "X" for event in events) == 4 * 8 * 2
    code, out, _ = run(capsys, "simulate", "--schedule-file", str(export), "--costs", str(costs), "--json")
    assert code == 0 and json.loads(out) == first


def test_show_and_validate(capsys, tmp_path):
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2")
    assert out.splitlines()[1].split() == ["d0", "0F0", "0F1", "0BW0", "0BW1"]
    code, out, _ = run(capsys, "show", "1f1b", "-p", "2", "-m", "2", "--text")
    assert out.splitlines()[1:] == ["0F0 0F1 0BW0 0BW1", "1F0 1BW0 1F1 1BW1"]
    good = tmp_path / "good.json"
    build_schedule("gpipe", 2, 2).to_json(good)
    code, out, _ = run(capsys, "validate", str(good))
    assert code == 0 and "valid 'gpipe'" in out


def deadlocked_file(tmp_path):
    schedule = build_schedule("1f1b", 2, 2)
    swapped = schedule.with_devices([schedule.devices[0], tuple(reversed(schedule.devices[1]))])
    path = tmp_path / "deadlock.json"
    swapped.to_json(path)
    return path


def test_validate_prints_the_marked_grid(capsys, tmp_path):
    code, out, err = run(capsys, "validate", str(deadlocked_file(tmp_path)))
    assert code == 2 and out == ""
    assert err.startswith("pipeloom: error: deadlock in schedule '1f1b'")
    assert "[" in err and "step" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["simulate", "nope", "-p", "2", "-m", "2"], "unknown schedule 'nope'"),
        (["simulate", "interleaved", "-p", "4", "-m", "6"], "must be a multiple of the number of devices"),
        (["simulate", "chimera", "-p", "3", "-m", "2"], "must be even"),
        (["simulate", "1f1b", "-p", "4"], "needs -p (devices) and -m (micro-batches)"),
        (["simulate", "1f1b", "-p", "x", "-m", "2"], "invalid int value"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--costs", "F=1,X=2"], "unknown cost key"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--costs", "missing.json"], "cannot read costs file"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--plot", "t.gif"], "use a .png, .svg or .pdf"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--export", "no/such/dir/s.json"], "does not exist"),
        (["simulate", "--schedule-file", "missing.json"], "cannot read schedule file"),
        (["simulate", "1f1b", "--schedule-file", "s.json"], "not both"),
        (["frobnicate"], "invalid choice"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--mem-limit", "3"], "takes no memory limit"),
        (["simulate", "zb-auto", "-p", "2", "-m", "2", "--mem-limit", "lots"], "memory budget 'lots'"),
        (["simulate", "zb-auto", "-p", "2", "-m", "2", "--mem-limit", "0.5"], "raise the limit to at least 1"),
        (["simulate", "zb-auto", "-p", "2", "-m", "2", "--mem-limit", "1,2,3"], "3 memory limits given for 2"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--batch-w"], "--batch-w needs --split"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--split", "later"], "invalid choice"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--time-limit", "3"], "--time-limit applies to --exact"),
        (["simulate", "chimera", "-p", "2", "-m", "2", "--exact"], "replicated"),
        (["pareto", "-p", "2", "-m", "2", "--budgets", "0"], "at least 1"),
        (["pareto", "-p", "0", "-m", "2"], "num_devices must be at least 1"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--ckpt", "some"], "invalid choice"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--ckpt", "mario", "--exact"], "cannot be combined with --ckpt"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--ckpt", "mario", "--mem-limit", "0.5"], "device 0 needs"),
        (["pareto", "-p", "2", "-m", "2", "--plot", "f.gif"], "use a .png, .svg or .pdf"),
        (["simulate", "tpipe", "-p", "1", "-m", "2"], "num_devices (p) must be at least 2"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--recompute", "shallow"], "at least 2 chunks"),
        (["simulate", "tpipe", "-p", "2", "-m", "2", "--recompute", "0,x"], "comma-separated integers"),
        (["simulate", "tpipe", "-p", "2", "-m", "2", "--recompute", "0", "--ckpt", "full"], "cannot be combined"),
        (["simulate", "tpipe", "-p", "2", "-m", "2", "--offload-stages", "2"], "apply to --offload"),
        (["simulate", "tpipe", "-p", "2", "-m", "2", "--offload", "--costs", "offload_bytes=1"], "host_bandwidth"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--offload"], "name the stages"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--slices", "2"], "does not take --slices"),
        (["simulate", "svpp", "-p", "2", "-m", "2", "--slices", "2", "--forwards", "1"], "at least 2"),
        (["simulate", "svpp", "-p", "2", "-m", "2", "--forwards", "4", "--mem-limit", "1"], "not both"),
        (["simulate", "svpp", "-p", "4", "-m", "4", "-v", "2", "--mem-limit", "0.1"], "device 0 needs"),
        (["simulate", "1f1b", "-p", "2", "-m", "2", "--weight-parts", "0"], "positive integer"),
        (["simulate", "--schedule-file", "s.json", "--slices", "2"], "not both"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("pipeloom: error:")
    assert message in err
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_deadlocked_schedule_file_is_one_line_for_simulate(capsys, tmp_path):
    path = deadlocked_file(tmp_path)
    code, _, err = run(capsys, "simulate", "--schedule-file", str(path))
    assert code == 2 and err.count("\n") == 1 and "deadlock" in err


def test_console_script_exit_status_and_no_traceback():
    result = subprocess.run(
        [sys.executable, "-m", "pipeloom", "simulate", "chimera", "-p", "5", "-m", "2"], capture_output=True, text=True
    )
    assert result.returncode == 2
    assert (
        result.stderr.strip() == "pipeloom: error: chimera: number of devices (5) must be even "
        "(two pipelines of p stages share them)"
    )
    assert "Traceback" not in result.stderr


def test_compare(capsys, tmp_path):
    code, out, err = run(
        capsys,
        "compare",
        "gpipe",
        "1f1b",
        "interleaved",
        "chimera",
        "-p",
        "4",
        "-m",
        "8",
        "-v",
        "2",
        "--plot-dir",
        str(tmp_path / "plots"),
    )
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[3:]] == ["gpipe", "1f1b", "interleaved", "chimera"]
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "1f1b.png",
        "chimera.png",
        "gpipe.png",
        "interleaved.png",
    ]


def test_simulate_memory_driven_schedules_and_split(capsys):
    costs = "F=1,B=1,W=1,M_W=0.5"
    code, out, _ = run(
        capsys, "simulate", "zb-auto", "-p", "4", "-m", "8", "--costs", costs, "--mem-limit", "4", "--json"
    )
    assert code == 0
    result = json.loads(out)
    assert max(result["peak_memory"]) <= 4 and result["cost"] == 27  # ZB-H1's bubble at 1F1B's memory
    code, out, _ = run(capsys, "simulate", "v-auto", "-p", "2", "-m", "4", "--mem-limit", "1,2", "--json")
    assert code == 0 and [a <= b for a, b in zip(json.loads(out)["peak_memory"], [1, 2])] == [True, True]
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--costs", costs, "--split", "fill", "--json")
    assert code == 0 and json.loads(out)["name"] == "1f1b+split-fill"
    code, out, _ = run(capsys, "show", "gpipe", "-p", "2", "-m", "2", "--split", "deferred", "--batch-w", "--text")
    assert out.splitlines()[1:] == ["0F0 0F1 0B0 0B1 0W0 0W1", "1F0 1F1 1B0 1B1 1W0 1W1"]


def test_simulate_exact_reports_bound_and_gap(capsys):
    pytest.importorskip("ortools")
    code, out, _ = run(capsys, "simulate", "zb-h1", "-p", "3", "-m", "4", "--costs", "F=1,B=1,W=1", "--exact")
    assert code == 0 and "exact (CP-SAT, optimal" in out and "gap 0.00%" in out
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "3", "-m", "4", "--exact", "--time-limit", "5", "--json")
    exact = json.loads(out)["exact"]
    assert exact["cost"] <= exact["hint_cost"] and exact["bound"] <= exact["cost"] + 1e-6


def test_pareto_table_json_and_plot(capsys, tmp_path):
    costs = "F=1,B=1,W=1,M_W=0.25"
    code, out, _ = run(capsys, "pareto", "-p", "4", "-m", "8", "--costs", costs, "--json", "--budgets", "4")
    assert code == 0
    points = json.loads(out)
    labels = {p["label"] for p in points}
    assert {"1f1b", "zb-h1", "zb-h2", "zb-v", "v-half", "v-min", "1f1b+split-fill"} <= labels
    assert any(label.startswith("zb-auto@") for label in labels) and any(
        label.startswith("v-auto@") for label in labels
    )
    frontier = [p for p in points if p["on_frontier"]]
    assert frontier and all(  # nothing dominates a frontier point
        not (q["peak_activation_memory"] <= f["peak_activation_memory"] and q["bubble_rate"] < f["bubble_rate"] - 1e-12)
        for f in frontier
        for q in points
    )
    assert min(p["bubble_rate"] for p in frontier) == pytest.approx(0.0)  # zb-v, F = B = W
    plot = tmp_path / "frontier.png"
    code, out, _ = run(capsys, "pareto", "-p", "4", "-m", "8", "--costs", costs, "--frontier-only", "--plot", str(plot))
    assert code == 0 and plot.stat().st_size > 0
    assert all(line.startswith("*") for line in out.splitlines()[3:])


def test_pareto_leaves_out_what_per_stage_costs_do_not_price(capsys, tmp_path):
    """Costs listed for 2 stages price the 2-stage schedules; a V (4 stages) and the budgeted
    V (v-auto, whose budgets are read off the costs) are left out with the reason, not a crash."""
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"F": [1.0, 1.2], "B": [1.0, 1.2], "W": [0.5, 0.5], "M_W": 0.25}))
    code, out, err = run(capsys, "pareto", "-p", "2", "-m", "4", "--costs", str(costs), "--json", "--budgets", "2")
    labels = {point["label"] for point in json.loads(out)}
    assert code == 0 and "1f1b" in labels and "zb-v" not in labels and not any(x.startswith("v-auto") for x in labels)
    assert "left out v-auto: costs: F has 2 per-stage values but the schedule has 4 stages" in err


def test_simulate_checkpointing(capsys):
    costs = "F=1,B=2,R=1"
    results = {}
    for mode in ("none", "full", "mario"):
        code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "4", "--costs", costs, "--ckpt", mode, "--json")
        assert code == 0
        results[mode] = json.loads(out)
    assert [results[mode]["makespan"] for mode in ("none", "full", "mario")] == [21, 28, 21]
    assert max(results["mario"]["peak_memory"]) == 1 and max(results["none"]["peak_memory"]) == 4
    code, out, _ = run(
        capsys,
        "simulate",
        "1f1b",
        "-p",
        "8",
        "-m",
        "8",
        "--costs",
        costs,
        "--ckpt",
        "mario",
        "--mem-limit",
        "4",
        "--json",
    )
    assert code == 0 and max(json.loads(out)["peak_memory"]) <= 4


def test_simulate_tpipe_with_trecomp_and_offload(capsys, tmp_path):
    costs = "F=1,B=2,M_ckpt=0,M_static=4,M_offload=2,offload_bytes=2,reload_bytes=2,host_bandwidth=1"
    argv = ["simulate", "tpipe", "-p", "4", "-m", "8", "--costs", costs]
    code, out, _ = run(capsys, *argv, "--json")
    assert code == 0
    plain = json.loads(out)
    assert plain["makespan"] == 33 and plain["bubble_rate"] == pytest.approx(3 / 11)
    code, out, _ = run(capsys, *argv, "--recompute", "shallow", "--offload", "--json")
    result = json.loads(out)
    assert result["name"] == "tpipe+trecomp" and max(result["peak_activation_memory"]) == 1.5  # (4//2 + 1) blocks
    offload = result["offload"]
    assert offload["stages"] == [4, 5, 6, 7] and offload["static_memory_saved"] == [1.0] * 4
    assert offload["on_time_fraction"] == 1.0 and offload["delay"] == 0
    assert 0 < offload["overlap_fraction"] < 1 and len(offload["windows"]) == 4
    assert result["static_memory"] == [3.0] * 4
    assert {op["op"] for op in offload["lane_ops"]} == {"RELOAD", "OFFLOAD", "HOST_STEP"}
    plot, trace = tmp_path / "t.png", tmp_path / "t.json"
    code, out, _ = run(capsys, *argv, "--offload", "--reload-bits", "8", "--plot", str(plot), "--trace", str(trace))
    assert code == 0 and plot.stat().st_size > 0
    names = {
        event["args"]["name"]
        for event in json.loads(trace.read_text())["traceEvents"]
        if event.get("name") == "thread_name"
    }
    assert {"device 0", "device 0 copy", "device 3 copy"} <= names  # no host work in these costs
    assert "T-Offload    stages 4,5,6,7, reloads at 8 bits" in out and "100.00% before its deadline" in out


def test_simulate_slice_level_schedules(capsys):
    base = ["-p", "4", "-m", "4", "--costs", "F=1,B=1", "--json"]
    code, out, _ = run(capsys, "simulate", "svpp", "-v", "2", "--slices", "2", *base)
    assert code == 0
    result = json.loads(out)
    assert result["num_slices"] == 2 and result["num_stages"] == 8
    assert max(result["peak_activation_memory"]) == 4 * 9 / 16  # Fig. 4(b): 9/16 A, A = 4 device shares
    assert result["bubble_rate"] == pytest.approx(3 / 19)
    code, out, _ = run(capsys, "simulate", "svpp", "-v", "2", "--slices", "2", "--forwards", "4", *base)
    assert max(json.loads(out)["peak_activation_memory"]) == 1.0  # v·s = 4 forwards of A/16
    code, out, _ = run(capsys, "simulate", "svpp", "-v", "2", "--slices", "2", "--mem-limit", "1.6", *base)
    assert max(json.loads(out)["peak_activation_memory"]) <= 1.6
    code, out, _ = run(capsys, "simulate", "terapipe", "--slices", "4", *base)
    assert json.loads(out)["bubble_rate"] == pytest.approx(3 / 19)
    code, out, _ = run(
        capsys,
        "simulate",
        "svpp",
        "--slices",
        "2",
        "-p",
        "4",
        "-m",
        "4",
        "--costs",
        "F=1,B=1,W=0.5",
        "--weight-parts",
        "4",
    )
    assert code == 0 and "svpp+wparts" in out
    code, out, _ = run(capsys, "compare", "svpp", "terapipe", "1f1b", "-p", "4", "-m", "4", "--slices", "2")
    assert code == 0 and "terapipe" in out


def test_tune_on_presets_writes_plan_and_timeline(capsys, tmp_path):
    plan = tmp_path / "plan.json"
    argv = [
        "tune",
        "--model",
        "zb-1.5b",
        "--hardware",
        "rtx-4090",
        "--devices",
        "8",
        "--global-batch",
        "16",
        "--schemes",
        "1f1b,zb-h1,chimera",
        "--max-mbs",
        "2",
        "--output",
        str(plan),
    ]
    code, out, _ = run(capsys, *argv, "--explain")
    assert code == 0
    assert "1. " in out and "why the others lost" in out and "best plan written to" in out
    saved = json.loads(plan.read_text())
    assert saved["format"] == "pipeloom.plan/1" and saved["pp"] * saved["dp"] == 8
    assert sum(saved["partition"]) == 22 and saved["predicted"]["step_time_ms"] > 0
    assert (tmp_path / "plan.png").stat().st_size > 0
    code, out, _ = run(capsys, "validate", str(plan))  # a plan's schedule and costs are read where a schedule's are
    assert code == 0 and f"valid {saved['scheme']!r}" in out
    code, out, _ = run(capsys, "simulate", "--schedule-file", str(plan), "--costs", str(plan), "--json")
    assert code == 0 and json.loads(out)["makespan"] == pytest.approx(saved["predicted"]["pipeline_ms"])
    before = plan.read_text()
    code, out, err = run(capsys, *argv, "--json", "--top", "3")  # a second run overwrites nothing by default
    assert code == 2 and "already exist" in err and "--force" in err and plan.read_text() == before
    code, out, _ = run(capsys, *argv, "--json", "--top", "3", "--force")
    ranked = json.loads(out)
    assert len(ranked) == 3 and ranked[0]["step_time_ms"] <= ranked[1]["step_time_ms"]


CORES = len(os.sched_getaffinity(0))
TUNE = ["tune", "--model", "gpt3-13b", "--hardware", "h100", "--devices", "8", "--global-batch", "8"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["tune", "--model", "gpt5", "--hardware", "h100", "--devices", "8", "--global-batch", "8"], "unknown model"),
        (["tune", "--model", "gpt3-13b", "--devices", "8", "--global-batch", "8"], "needs --hardware"),
        ([*TUNE, "--costs", "p.json"], "not allowed with"),
        (
            ["tune", "--model", "gpt3-175b", "--hardware", "a100-40g", "--devices", "8", "--global-batch", "8"]
            + ["--schemes", "1f1b"],
            "no plan fits",
        ),
        ([*TUNE, "--schemes", "hanayo"], "unknown scheme"),
        ([*TUNE, "--schemes", "terapipe"], "tune does not search terapipe as a scheme (svpp with every forward"),
        ([*TUNE, "--schemes", "1f1b,v-auto"], "tune searches v-auto as zb-v: pass --schemes zb-v"),
        ([*TUNE, "--memory", "lots"], "memory budget"),
        ([*TUNE, "--output", "no/dir/p.json"], "does not exist"),
        (["train", "--plan", "missing.json"], "cannot read plan"),
        (["profile", "--model", "gpt3-13b"], "too large"),
        (
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--max-rounds", "1"],
            "--max-rounds must be at least 2",
        ),
        (
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--tp", "2"],
            "tensor parallelism is measured at --tp N > 1 on a Hugging Face model",
        ),
        (
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--sequence-parallel"],
            "--tp 1 --sequence-parallel",
        ),
        (
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--slices", "2,5"],
            "--slices 2,5: each slice count must be at least 2 and divide the sequence length (64 tokens)",
        ),
        (["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--slices", "1"], "must be at least 2"),
        (["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--steps", "0"], "--steps >= 1"),
        (["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--threads", "0"], "--threads >= 1"),
        (  # the ranks' threads outnumber the cores: read as a busy machine, which it was not
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--threads", str(max(2, CORES))],
            "two ranks of",
        ),
        (  # one layer count twice: no slope per layer (it priced every layer at 0 ms)
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--layers", "2,2"],
            "at least two different layer counts",
        ),
        (
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--data", str(EXAMPLES / "train.bin")],
            "--data feeds hf: models' probes",
        ),
        (  # the built-in decoder's sequence is its config's: the flag was ignored
            ["profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--seq-len", "32"],
            "--seq-len is for hf: models; the built-in decoder runs its config's sequence (64 tokens",
        ),
    ],
)
def test_tune_refusals_are_one_line(capsys, tmp_path, monkeypatch, argv, message):
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "command, advice",
    [
        (["show", "plan.json"], "pass --schedule-file plan.json"),
        (["simulate", "plan.json"], "pass --schedule-file plan.json"),
        (
            ["compare", "1f1b", "plan.json", "-p", "2", "-m", "4"],
            "`pipeloom simulate --schedule-file plan.json` reads it",
        ),
    ],
)
def test_a_file_given_as_a_schedule_s_name_is_named_as_a_file(capsys, tmp_path, monkeypatch, command, advice):
    """`show plan.json` had said the schedule 'plan.json' needs -p and -m."""
    monkeypatch.chdir(tmp_path)
    Path("plan.json").write_text("{}")
    code, out, err = run(capsys, *command)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert "'plan.json' is a file, not a schedule's name: " in err and advice in err


def test_a_profile_a_plan_and_costs_given_for_one_another_are_named(capsys, tmp_path, monkeypatch):
    """A profile passed as a plan, a plan as a profile, costs written out for `tune --costs`."""
    monkeypatch.chdir(tmp_path)
    Path("profile.json").write_text(json.dumps({"format": "pipeloom.profile/2"}))
    Path("plan.json").write_text(json.dumps({"format": "pipeloom.plan/1"}))
    tune = ["tune", "--devices", "2", "--global-batch", "8", "--memory", "1GiB", "--costs"]
    for argv, message in [
        (
            ["train", "--plan", "profile.json"],
            "'profile.json': a profile (pipeloom.profile/2), not a plan: `pipeloom tune",
        ),
        ([*tune, "plan.json"], "not a pipeloom.profile/2 file, but a pipeloom.plan/1 one"),
        ([*tune, "F=1,B=2"], "tune --costs takes a profile (`pipeloom profile`), not costs written out (F=1,B=2)"),
    ]:
        code, out, err = run(capsys, *argv)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_profile_is_never_overwritten_without_force(capsys, tmp_path, monkeypatch):
    """A profile can take hours: a rerun into the same file is refused before any probe runs."""
    monkeypatch.chdir(tmp_path)
    Path("profile.json").write_text("an earlier run's profile\n")
    code, out, err = run(capsys, "profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--output", "profile.json")
    assert code == 2 and out == "" and err.count("\n") == 1 and "profile.json already exists: pass --force" in err
    assert Path("profile.json").read_text() == "an earlier run's profile\n"


def test_a_profile_on_a_gpu_this_machine_lacks_is_refused_in_one_line(capsys, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: `bench/gpu.py` profiles on it")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "profile", "--model", str(EXAMPLES / "tiny-llama.json"), "--device", "cuda")
    assert code == 2 and out == "" and err == "pipeloom: error: profile --device cuda: torch sees no CUDA device here\n"
    assert list(tmp_path.iterdir()) == []


def test_a_plan_runs_enough_steps_to_tell_its_error_from_the_noise():
    from argparse import Namespace

    from pipeloom.cli.plan import _noise
    from pipeloom.cli.train_args import steps_of

    assert steps_of(Namespace(steps=None, plan="plan.json")) == 7  # 5 timed after 2 of warm-up
    assert steps_of(Namespace(steps=None, plan=None)) == 3 and steps_of(Namespace(steps=4, plan="plan.json")) == 4
    assert _noise([0.100, 0.104, 0.096, 0.102, 0.098]) == "the steps' noise ±4.0% over 5 timed steps"
    assert _noise([0.1, 0.11]).endswith("2 timed steps; too few to trust: run --steps 7 or more")


def test_a_plans_measured_step_is_taken_over_the_steps_the_profile_would_keep():
    """A slow spell of the host in a run is left out of its median by the profile's own rule, and
    the report says what all the steps made it."""
    from types import SimpleNamespace

    from pipeloom.cli.plan import fidelity_report
    from pipeloom.costs import Costs

    step_ms = [300, 200, 100, 150, 152, 101, 99, 151, 100]  # 2 of warm-up, then a spell of 3 slow steps

    def rank():
        records = [SimpleNamespace(ops=[("F0", 0.0, ms / 1e3)], began=0.0, peak_stash_bytes=0) for ms in step_ms]
        phases = [dict(pipeline=ms / 1e3, allreduce=0.0, optimizer=0.0, overhead=0.0) for ms in step_ms]
        seconds = [ms / 1e3 for ms in step_ms]
        return SimpleNamespace(
            records=records, step_seconds=seconds, phase_seconds=phases, static_bytes=None, peak_memory_bytes=None
        )

    plan = SimpleNamespace(predicted={"step_time_ms": 100.0, "band_ms": 2.5}, pp=2, dp=1, cp=1, tp=1)
    plan.schedule, plan.costs = build_schedule("1f1b", 2, 1), Costs(F=1.0, B=1.0)
    step = next(line for line in fidelity_report(plan, [rank(), rank()]).splitlines() if "step time" in line)
    assert "vs     100.0 ms  (+0.0%; the profile's band ±2.5%; the steps' noise ±26.2% over 7 timed steps" in step
    assert step.endswith("3 step(s) in a slow spell of the host left out, as the profile does: all 7, 101.0 ms)")


def test_the_breakdown_reads_the_phases_of_the_rank_whose_pipeline_ended_last():
    """A rank done sooner waits for the other at the step's loss all-reduce: its overhead is the
    other's pipeline, not the runtime's own."""
    from types import SimpleNamespace

    from pipeloom.runtime.plan_run import last_pipeline_phases

    def rank(pipeline: float, overhead: float):
        phases = dict(pipeline=pipeline, allreduce=0.0, optimizer=0.01, overhead=overhead)
        return SimpleNamespace(phase_seconds=[phases] * 3)

    early, late = rank(0.150, 0.052), rank(0.200, 0.002)
    assert last_pipeline_phases([early, late]) == late.phase_seconds
