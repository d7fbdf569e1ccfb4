"""What a newcomer meets first: help that ends with examples, one spelling of the schedule
argument, units on every figure, per-device idle that is the device's own, no silent overwrite."""

import json

import pytest

from pipeloom import Costs, build_schedule, simulate
from pipeloom.cli import build_parser, main
from pipeloom.errors import ConfigError

COMMANDS = ["list", "simulate", "pareto", "profile", "tune", "train", "export-plan", "show", "validate", "compare"]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("command", COMMANDS)
def test_every_help_ends_with_examples(capsys, command):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    tail = capsys.readouterr().out.rstrip().split("examples:\n")[-1].splitlines()
    assert 1 <= len(tail) <= 3 and all(line.strip().startswith("pipeloom ") for line in tail)


def test_the_schedule_is_named_the_same_way_everywhere(capsys):
    plain = run(capsys, "simulate", "zb-h1", "-p", "4", "-m", "8", "--json")[1]
    flagged = run(capsys, "simulate", "--schedule", "zb-h1", "-p", "4", "-m", "8", "--json")[1]
    assert plain == flagged
    assert (
        run(capsys, "show", "--schedule", "1f1b", "-p", "2", "-m", "2")[1]
        == run(capsys, "show", "1f1b", "-p", "2", "-m", "2")[1]
    )
    listed = run(capsys, "compare", "1f1b", "zb-h1", "-p", "4", "-m", "8", "--json")[1]
    assert run(capsys, "compare", "--schedule", "1f1b,zb-h1", "-p", "4", "-m", "8", "--json")[1] == listed
    code, _, err = run(capsys, "simulate", "1f1b", "--schedule", "zb-h1", "-p", "4", "-m", "8")
    assert code == 2 and "two schedule names" in err
    parser = build_parser()
    for spelling in (["train", "zb-v"], ["train", "--schedule", "zb-v"]):
        args = parser.parse_args([*spelling, "-p", "2", "-m", "4"])
        assert (args.name or args.schedule_flag) == "zb-v"


def test_bare_costs_print_in_units_and_m_b(capsys):
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8")
    assert code == 0
    assert "makespan     33 units" in out and "peak memory  4 M_B" in out and "span (units)" in out
    summary = json.loads(run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8", "--json")[1])
    assert summary["time_unit"] == "units" and summary["memory_unit"] == "M_B"


def test_costs_in_ms_and_bytes_print_with_those_units(capsys, tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"F": 2.0, "B": 4.0, "M_B": 3 * 2**30, "time_unit": "ms", "memory_unit": "bytes"}))
    code, out, _ = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--costs", str(costs))
    assert code == 0 and "makespan     30 ms" in out and "peak memory  6.00 GiB" in out and "(GiB)" in out
    code, out, _ = run(capsys, "compare", "1f1b", "gpipe", "-p", "2", "-m", "4", "--costs", str(costs))
    assert "makespan (ms)" in out and "peak mem (GiB)" in out and "12.00" in out  # gpipe: 4 × 3 GiB
    inline = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--costs", "F=1,B=2,time_unit=ms", "--json")[1]
    assert json.loads(inline)["time_unit"] == "ms"
    code, _, err = run(capsys, "simulate", "1f1b", "-p", "2", "-m", "4", "--costs", "F=1,time_unit=hours")
    assert code == 2 and "time_unit must be one of ms, s, us" in err


def test_costs_keep_their_units_through_json():
    costs = Costs(F=1, time_unit="ms", memory_unit="bytes")
    assert Costs.from_mapping(costs.to_dict()) == costs
    assert "time_unit" not in Costs().to_dict()
    with pytest.raises(ConfigError, match="memory_unit"):
        Costs(memory_unit="GiB")


def test_a_device_busy_through_its_span_has_no_idle_share(capsys):
    timeline = simulate(build_schedule("1f1b", 4, 8))
    shares = timeline.device_idle_shares()
    assert shares[3] == 0.0 and timeline.spans[3] == timeline.useful_time[3]  # last stage: never waits
    assert shares[0] == pytest.approx((33 - 24) / 33)
    out = run(capsys, "simulate", "1f1b", "-p", "4", "-m", "8")[1]
    assert [line.split()[3] for line in out.splitlines() if line[:2] in ("d0", "d1", "d2", "d3")] == [
        "27.27%",
        "20.00%",
        "11.11%",
        "0.00%",
    ]


def test_compare_plot_is_one_file(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "all.png"
    code, _, _ = run(capsys, "compare", "1f1b", "zb-h1", "zb-v", "-p", "4", "-m", "8", "--plot", str(path))
    assert code == 0 and [p.name for p in tmp_path.iterdir()] == ["all.png"] and path.stat().st_size > 0
    code, _, err = run(capsys, "compare", "1f1b", "-p", "4", "-m", "8", "--plot", str(tmp_path / "x.bmp"))
    assert code == 2 and "use a .png" in err


def test_progress_is_live_on_a_terminal_and_sparse_off_one(monkeypatch, capsys):
    """A bar on a terminal; off one (a log, a pipe) nothing for short work, a plain line now and
    then for long work (see test_hardening's long planning test); nothing with --quiet."""
    from pipeloom.cli import output

    monkeypatch.setattr(output.sys.stderr, "isatty", lambda: False, raising=False)
    quick = output.progress_bar("tune")
    for done in range(1, 5):
        quick(done, 4)
    assert capsys.readouterr().err == ""  # done within its first 10 s: silent
    assert output.progress_bar("tune", quiet=True) is None
    monkeypatch.setattr(output.sys.stderr, "isatty", lambda: True, raising=False)
    assert output.progress_bar("tune", quiet=True) is None
    report = output.progress_bar("tune", unit="candidate")
    for done in range(1, 5):
        report(done, 4)
    assert "tune:" in capsys.readouterr().err


def test_tune_refuses_zero_jobs(capsys, tmp_path):
    code, _, err = run(
        capsys,
        "tune", "--model", "zb-1.5b", "--hardware", "rtx-4090", "--devices", "2", "--global-batch", "4",
        "--jobs", "0", "--output", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert code == 2 and "--jobs must be at least 1" in err


def test_explain_says_in_one_line_why_no_pipeline(capsys, tmp_path):
    code, out, _ = run(
        capsys,
        "tune", "--model", "zb-1.5b", "--hardware", "h100", "--devices", "2", "--global-batch", "8", "--tp", "1",
        "--pp", "1", "--schemes", "1f1b", "--explain", "--jobs", "1", "--output", str(tmp_path / "plan.json"),
    )  # fmt: skip
    assert code == 0
    (line,) = [line for line in out.splitlines() if line.startswith("why no pipeline:")]
    assert "1f1b pp=2 dp=1" in line and "ms per step" in line and "idle" in line
