"""Trace JSON and timeline pictures describe the simulated timeline."""

import json

import pytest

from pipeloom import ConfigError, Costs, Schedule, build_schedule, simulate
from pipeloom.viz import chrome_trace, plot_timeline, write_chrome_trace


def test_chrome_trace_has_one_track_per_device_and_ops_named_by_text(tmp_path):
    timeline = simulate(build_schedule("1f1b", 2, 2), Costs(F=1, B=2))
    trace = chrome_trace(timeline, time_unit_us=1000)
    threads = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert threads == {0: "device 0", 1: "device 1"}
    ops = [(e["tid"], e["name"], e["ts"], e["dur"]) for e in trace["traceEvents"] if e["ph"] == "X"]
    assert ops[:4] == [(0, "0F0", 0, 1000), (0, "0F1", 1000, 1000), (0, "0BW0", 4000, 2000), (0, "0BW1", 7000, 2000)]
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["name"] == "memory device 0"]
    assert max(e["args"]["memory"] for e in counters) == 2
    path = tmp_path / "t.json"
    write_chrome_trace(timeline, path)
    assert json.loads(path.read_text()) == trace


@pytest.mark.parametrize("suffix", ["png", "svg"])
def test_plot_writes_the_requested_format(tmp_path, suffix):
    schedule = Schedule.from_text("0F0c 0F1 0R0 0BW0 0B1 0W1:0/2 0W1:1/2")
    path = tmp_path / f"t.{suffix}"
    plot_timeline(simulate(schedule), path)
    head = path.read_bytes()[:64]
    assert head.startswith(b"\x89PNG") if suffix == "png" else b"<?xml" in head or b"<svg" in head


def test_plot_refuses_unknown_formats(tmp_path):
    with pytest.raises(ConfigError, match="use a .png, .svg or .pdf"):
        plot_timeline(simulate(build_schedule("1f1b", 2, 2)), tmp_path / "t.bmp")
    assert list(tmp_path.iterdir()) == []
