"""Several schedules in one figure: a row of op boxes per schedule on one shared time axis, and
beneath them each schedule's fullest device's memory, so lengths and peaks compare at a glance."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

from pipeloom.sim.simulate import Timeline
from pipeloom.units import memory_scale, time_unit
from pipeloom.viz.plot import LEGEND_OUTSIDE, check_plot_path, draw_ops, legend_handles, pyplot, save_figure

__all__ = ["comparison_figure", "plot_comparison"]


def plot_comparison(timelines: Sequence[Timeline], path: str | PathLike[str]) -> None:
    check_plot_path(path)
    save_figure(comparison_figure(timelines), path)


def comparison_figure(timelines: Sequence[Timeline]):
    plt = pyplot()
    costs = timelines[0].costs
    unit = time_unit(costs)
    memory = memory_scale(costs, [x for t in timelines for x in t.peak_memory])
    heights = [0.6 + 0.3 * t.num_devices for t in timelines] + [2.6]
    figure, axes = plt.subplots(
        len(heights), 1, figsize=(13, sum(heights) + 0.8), sharex=True, gridspec_kw={"height_ratios": heights}
    )
    longest = max(t.makespan for t in timelines)
    colors = plt.get_cmap("tab10")
    handles: dict[str, object] = {}
    for index, (ax, timeline) in enumerate(zip(axes, timelines)):
        draw_ops(ax, timeline, label_share=longest / timeline.makespan / 90 if timeline.makespan else 1 / 90)
        ax.set_ylabel(timeline.schedule.name, rotation=0, ha="right", va="center", fontsize=9)
        ax.set_title(
            f"{timeline.schedule.name}: {timeline.makespan:.4g} {unit}, bubble {timeline.bubble_rate:.1%}, "
            f"peak {memory.text(max(timeline.peak_memory))}",
            loc="left",
            fontsize=8,
            color=colors(index % 10),
        )
        for handle in legend_handles(timeline):
            handles.setdefault(handle.get_label(), handle)
        fullest = max(range(timeline.num_devices), key=lambda d: timeline.peak_memory[d])
        points = timeline.memory_curve(fullest)
        axes[-1].step(
            [t for t, _ in points] + [timeline.makespan],
            [memory.value(level) for _, level in points] + [memory.value(points[-1][1])],
            where="post",
            linewidth=1.2,
            color=colors(index % 10),
            label=f"{timeline.schedule.name} (d{fullest})",
        )
    boxes_first = sorted(handles.values(), key=lambda handle: not hasattr(handle, "get_facecolor"))
    axes[0].legend(handles=boxes_first, title="ops", **LEGEND_OUTSIDE)
    axes[-1].set_ylabel(f"memory ({memory.unit})\nfullest device")
    axes[-1].set_xlabel(f"time ({unit})")
    axes[-1].legend(title="schedule", **LEGEND_OUTSIDE)
    figure.tight_layout()
    return figure
