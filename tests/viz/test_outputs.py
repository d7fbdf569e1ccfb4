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


def legend_labels(ax) -> list[str]:
    return [text.get_text() for text in ax.get_legend().get_texts()]


def test_timeline_legend_names_everything_drawn_and_axes_carry_units():
    pytest.importorskip("matplotlib")
    from pipeloom.passes import t_offload, t_recomp, weight_parts
    from pipeloom.passes.offload import simulate_offload
    from pipeloom.viz.plot import pyplot, timeline_figure

    costs = Costs(F=1, B=1, W=1, M_W=0.5, attention_fraction=0.1)
    sliced = weight_parts(build_schedule("svpp", 4, 4, num_chunks=2, num_slices=2, costs=costs), costs, parts=2)
    figure = timeline_figure(simulate(sliced, costs))
    ops_ax, mem_ax = figure.axes
    labels = legend_labels(ops_ax)
    assert {"F forward", "B input gradient", "W weight gradient", "chunk 1 (paler)", "W part"} <= set(labels)
    assert "micro-batch.slice" in labels
    assert mem_ax.get_xlabel() == "time (units)" and mem_ax.get_ylabel() == "memory (M_B)"
    assert "makespan" in ops_ax.get_title(loc="left") and "units" in ops_ax.get_title(loc="left")
    pyplot().close(figure)

    offload_costs = Costs(
        F=1,
        B=2,
        M_static=16,
        M_offload=14,
        offload_bytes=4,
        reload_bytes=4,
        host_step_flops=12,
        host_bandwidth=1,
        host_flops=1,
    )
    result = simulate_offload(t_offload(t_recomp(build_schedule("tpipe", 4, 8))), offload_costs)
    figure = timeline_figure(result.timeline, lanes=result.lane_ops)
    labels = legend_labels(figure.axes[0])
    assert {"R recompute", "F checkpointed (keeps its input)", "RELOAD (lane)", "OFFLOAD (lane)"} <= set(labels)
    pyplot().close(figure)


def test_measured_costs_plot_in_ms_and_bytes_scaled():
    pytest.importorskip("matplotlib")
    from pipeloom.viz.plot import pyplot, timeline_figure

    costs = Costs(F=2.5, B=5, M_B=3 * 2**20, time_unit="ms", memory_unit="bytes")
    figure = timeline_figure(simulate(build_schedule("1f1b", 2, 4), costs))
    mem_ax = figure.axes[1]
    assert mem_ax.get_xlabel() == "time (ms)" and mem_ax.get_ylabel() == "memory (MiB)"
    assert max(max(line.get_ydata()) for line in mem_ax.get_lines()) == pytest.approx(6.0)  # 2 × 3 MiB
    legend = mem_ax.get_legend()
    assert legend.get_bbox_to_anchor().x0 > mem_ax.get_window_extent().x1 - 1  # outside the data
    pyplot().close(figure)


def test_comparison_is_one_figure_on_one_time_axis():
    pytest.importorskip("matplotlib")
    from pipeloom.viz.compare_plot import comparison_figure
    from pipeloom.viz.plot import pyplot

    costs = Costs(F=1, B=1, W=1, M_W=0.5)
    timelines = [
        simulate(build_schedule(name, 4, 8, costs=costs) if name == "zb-v" else build_schedule(name, 4, 8), costs)
        for name in ("1f1b", "zb-h1", "zb-v")
    ]
    figure = comparison_figure(timelines)
    *ops_axes, mem_ax = figure.axes
    assert len(ops_axes) == 3 and all(ax.get_shared_x_axes().joined(ax, mem_ax) for ax in ops_axes)
    assert legend_labels(mem_ax) == ["1f1b (d0)", "zb-h1 (d0)", "zb-v (d0)"]
    assert mem_ax.get_xlabel() == "time (units)" and mem_ax.get_ylabel().startswith("memory (M_B)")
    pyplot().close(figure)


def test_pareto_labels_do_not_overlap():
    pytest.importorskip("matplotlib")
    from pipeloom.tune.pareto import explore_pareto
    from pipeloom.viz.pareto_plot import pareto_figure
    from pipeloom.viz.plot import pyplot

    costs = Costs(F=18.5, B=18.1, W=9.3, comm=0.6, M_W=0.37)
    figure = pareto_figure(explore_pareto(8, 24, costs, budgets=6), costs)
    ax = figure.axes[0]
    renderer = figure.canvas.get_renderer()
    boxes = [text.get_window_extent(renderer) for text in ax.texts]
    assert len(boxes) >= 5
    overlapping = [(i, j) for i in range(len(boxes)) for j in range(i) if boxes[i].overlaps(boxes[j])]
    assert overlapping == []
    assert "M_B" in ax.get_xlabel() and ax.get_ylabel() == "bubble rate (%)"
    pyplot().close(figure)
