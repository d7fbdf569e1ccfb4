"""The memory/bubble frontier as a picture: every point, the frontier as a staircase, and the
frontier's labels placed where they overlap neither each other nor the legend."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

from pipeloom.costs import Costs
from pipeloom.tune.pareto import ParetoPoint
from pipeloom.units import memory_scale
from pipeloom.viz.plot import LEGEND_OUTSIDE, check_plot_path, pyplot, save_figure

__all__ = ["pareto_figure", "plot_pareto"]

# Offsets (points) tried in turn for a label: right-above first, then around the point, then further out.
_OFFSETS = [(4, 4), (4, -10), (-4, 4), (-4, -10), (4, 14), (4, -20), (-4, 14), (-4, -20), (10, 24), (10, -30)]


def plot_pareto(
    points: Sequence[ParetoPoint], path: str | PathLike[str], costs: Costs | None = None, title: str | None = None
) -> None:
    check_plot_path(path)
    save_figure(pareto_figure(points, costs, title), path)


def pareto_figure(points: Sequence[ParetoPoint], costs: Costs | None = None, title: str | None = None):
    plt = pyplot()
    costs = costs or next((q.timeline.costs for q in points if q.timeline is not None), Costs())
    memory = memory_scale(costs, [q.peak_memory for q in points])
    figure, axes = plt.subplots(figsize=(9, 5.5))
    families: dict[str, list[ParetoPoint]] = {}
    for point in points:
        if not point.reference:
            families.setdefault(point.label.split("@")[0], []).append(point)
    colors = plt.get_cmap("tab20")
    for index, (family, members) in enumerate(families.items()):
        axes.scatter(
            [memory.value(q.peak_memory) for q in members],
            [100 * q.bubble_rate for q in members],
            s=24,
            alpha=0.8,
            color=colors(index % 20),
            marker="os^Dv<>p"[index % 8],
            label=family,
        )
    authors = [q for q in points if q.reference]
    if authors:
        axes.scatter(
            [memory.value(q.peak_memory) for q in authors],
            [100 * q.bubble_rate for q in authors],
            s=70,
            facecolors="none",
            edgecolors="red",
            linewidths=1.5,
            marker="*",
            label="the authors' schedules",
        )
    best = sorted((q for q in points if q.on_frontier), key=lambda q: q.peak_memory)
    if best:
        xs: list[float] = []
        ys: list[float] = []
        for q in best:
            if xs:
                xs.append(memory.value(q.peak_memory))
                ys.append(ys[-1])
            xs.append(memory.value(q.peak_memory))
            ys.append(100 * q.bubble_rate)
        axes.plot(xs, ys, color="black", linewidth=1.2, label="frontier")
    unit = "M_B of one device's share" if memory.unit == "M_B" else memory.unit
    axes.set_xlabel(f"peak activation memory per device ({unit})")
    axes.set_ylabel("bubble rate (%)")
    axes.set_title(title or "memory / bubble frontier")
    axes.grid(alpha=0.3)
    axes.legend(ncol=1 if len(families) <= 14 else 2, title="generator", **LEGEND_OUTSIDE)
    figure.tight_layout()
    named = best + authors
    _place_labels(figure, axes, [(q.label, memory.value(q.peak_memory), 100 * q.bubble_rate) for q in named])
    return figure


def _place_labels(figure, axes, labels: list[tuple[str, float, float]]) -> None:
    """Each label at the first offset whose box meets no label placed before it (the last tried
    if none is free): a greedy layout, enough for the tens of points a frontier has."""
    renderer = figure.canvas.get_renderer()
    placed: list = []
    for text, x, y in labels:
        for dx, dy in _OFFSETS:
            artist = axes.annotate(
                text,
                (x, y),
                xytext=(dx, dy),
                textcoords="offset points",
                fontsize=7,
                ha="left" if dx >= 0 else "right",
            )
            box = artist.get_window_extent(renderer)
            if not any(box.overlaps(other) for other in placed) or (dx, dy) == _OFFSETS[-1]:
                placed.append(box)
                break
            artist.remove()
