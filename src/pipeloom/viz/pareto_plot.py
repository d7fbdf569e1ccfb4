"""The memory/bubble frontier as a picture: every point, the frontier as a staircase."""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike

from pipeloom.tune.pareto import ParetoPoint
from pipeloom.viz.plot import check_plot_path, pyplot

__all__ = ["plot_pareto"]


def plot_pareto(points: Sequence[ParetoPoint], path: str | PathLike[str], title: str | None = None) -> None:
    check_plot_path(path)
    plt = pyplot()
    figure, axes = plt.subplots(figsize=(8, 5))
    families: dict[str, list[ParetoPoint]] = {}
    for point in points:
        families.setdefault(point.label.split("@")[0], []).append(point)
    colors = plt.get_cmap("tab20")
    for index, (family, members) in enumerate(families.items()):
        axes.scatter(
            [q.peak_memory for q in members],
            [100 * q.bubble_rate for q in members],
            s=24,
            alpha=0.8,
            color=colors(index % 20),
            marker="os^Dv<>p"[index % 8],
            label=family,
        )
    best = [q for q in points if q.on_frontier]
    if best:
        xs, ys = [], []
        for q in best:
            if xs:
                xs.append(q.peak_memory)
                ys.append(ys[-1])
            xs.append(q.peak_memory)
            ys.append(100 * q.bubble_rate)
        axes.plot(xs, ys, color="black", linewidth=1.2, label="frontier")
        for q in best:
            axes.annotate(
                q.label, (q.peak_memory, 100 * q.bubble_rate), fontsize=7, xytext=(3, 3), textcoords="offset points"
            )
    axes.set_xlabel("peak activation memory per device (M_B of one device's share)")
    axes.set_ylabel("bubble rate (%)")
    axes.set_title(title or "memory / bubble frontier")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
