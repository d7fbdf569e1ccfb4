"""Timeline picture: one row of op boxes per device, the memory curve of every device under it.

matplotlib is imported here, lazily, so the planning core never pays for it; install it with
``pip install 'pipeloom[plot]'``. The output format follows the file extension (png, svg, pdf).
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import OpKind
from pipeloom.sim.simulate import Timeline

__all__ = ["plot_timeline", "check_plot_path", "pyplot", "KIND_COLORS"]

KIND_COLORS = {
    OpKind.F: "#4C72B0",
    OpKind.B: "#55A868",
    OpKind.W: "#8172B3",
    OpKind.BW: "#2F8F5B",
    OpKind.R: "#DD8452",
}
LANE_COLORS = {"RELOAD": "#937860", "OFFLOAD": "#C44E52", "HOST_STEP": "#CCB974"}
_CKPT_COLOR = "#9DB4D8"  # a checkpointed forward keeps only its input: drawn paler
_MAX_LABELS = 1500


def has_matplotlib() -> bool:
    """Whether plots can be drawn here (matplotlib is the optional `plot` extra)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot():
    """matplotlib.pyplot on the Agg backend, or a ConfigError saying how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("plotting needs matplotlib: pip install 'pipeloom[plot]'") from None
    return plt


def check_plot_path(path: str | PathLike[str]) -> None:
    if Path(path).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"cannot plot to {str(path)!r}: use a .png, .svg or .pdf file name")


def plot_timeline(
    timeline: Timeline, path: str | PathLike[str], title: str | None = None, lanes: Sequence | None = None
) -> None:
    """Draw `timeline` to `path`; `lanes` (T-Offload's LaneOps) get rows of their own under the devices."""
    check_plot_path(path)
    plt = pyplot()
    from matplotlib.patches import Patch

    lane_rows = _lane_rows(lanes or ())
    num_rows = timeline.num_devices + len(lane_rows)
    height = 1.2 + 0.32 * num_rows
    fig, (ops_ax, mem_ax) = plt.subplots(
        2, 1, figsize=(12, height + 2.4), sharex=True, gridspec_kw={"height_ratios": [height, 2.4]}
    )
    _draw_ops(ops_ax, timeline)
    _draw_lanes(ops_ax, timeline.num_devices, lane_rows)
    _draw_memory(mem_ax, timeline)
    schedule = timeline.schedule
    ops_ax.set_title(
        title
        or f"{schedule.name}: p={schedule.num_devices} m={schedule.num_microbatches} S={schedule.num_stages}"
        f" — makespan {timeline.makespan:g}, bubble {timeline.bubble_rate:.1%}, peak memory {max(timeline.peak_memory):g}"
        + (f", lanes end {max(op.end for _, ops in lane_rows for op in ops):g}" if lane_rows else ""),
        loc="left",
        fontsize=10,
        pad=18,
    )
    kinds = sorted({op.kind for ops in schedule.devices for op in ops}, key=list(KIND_COLORS).index)
    handles = [Patch(color=KIND_COLORS[kind], label=kind.value) for kind in kinds]
    if any(op.ckpt for ops in schedule.devices for op in ops):
        handles.append(Patch(color=_CKPT_COLOR, label="F (ckpt)"))
    lane_kinds = sorted({op.kind.value for _, ops in lane_rows for op in ops}, key=list(LANE_COLORS).index)
    handles += [Patch(color=LANE_COLORS[kind], label=kind) for kind in lane_kinds]
    ops_ax.legend(
        handles=handles,
        loc="lower left",
        bbox_to_anchor=(0.0, 1.0),
        fontsize=8,
        ncol=len(handles),
        frameon=False,
        borderaxespad=0.1,
    )
    mem_ax.set_xlabel("time")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_ops(ax, timeline: Timeline) -> None:
    num_devices = timeline.num_devices
    label = timeline.graph.num_ops <= _MAX_LABELS
    sliced = timeline.schedule.num_slices > 1  # label micro-batch.slice
    min_label_width = timeline.makespan / 90 if timeline.makespan else 0
    for device in range(num_devices):
        chunk_of = {stage: i for i, stage in enumerate(timeline.schedule.stages_on(device))}
        boxes: dict[tuple[str, float, float], list[tuple[float, float]]] = {}
        paired: list[tuple[float, float]] = []
        in_pair = False  # the previous op overlaps this one: an F&B pair shares one cell, top and bottom
        for timing in timeline.timings(device):
            op = timing.op
            color = _CKPT_COLOR if op.ckpt else KIND_COLORS[op.kind]
            color = _lighten(color, 0.45 * chunk_of.get(op.stage, 0) / max(1, len(chunk_of) - 1))
            width = timing.end - timing.start
            bottom, height = (device, 0.4) if in_pair else (device - 0.4, 0.4 if op.overlap_next else 0.8)
            if op.overlap_next:
                paired.append((timing.start, width))
            in_pair = op.overlap_next
            boxes.setdefault((color, bottom, height), []).append((timing.start, width))
            if label and width >= min_label_width:
                ax.text(
                    timing.start + width / 2,
                    bottom + height / 2,
                    f"{op.microbatch}.{op.slice}" if sliced else str(op.microbatch),
                    ha="center",
                    va="center",
                    fontsize=6 if height > 0.5 else 4,
                    color="white",
                )
        for (color, bottom, height), spans in boxes.items():
            ax.broken_barh(spans, (bottom, height), facecolors=color, edgecolors="white", linewidth=0.3)
        if paired:
            ax.broken_barh(paired, (device - 0.4, 0.8), facecolors="none", edgecolors="black", linewidth=0.8)
    ax.set_yticks(range(num_devices), [f"d{d}" for d in range(num_devices)])
    ax.set_ylim(num_devices - 0.5, -0.5)
    ax.set_ylabel("device")


def _lane_rows(lanes: Sequence) -> list[tuple[str, list]]:
    """(label, ops) per device lane that does any work, devices in order, copy before host."""
    rows: dict[tuple[int, str], list] = {}
    for op in lanes:
        if op.end > op.start:
            rows.setdefault((op.device, op.kind.lane), []).append(op)
    return [(f"d{device} {lane}", rows[device, lane]) for device, lane in sorted(rows)]


def _draw_lanes(ax, num_devices: int, lane_rows: list[tuple[str, list]]) -> None:
    for row, (_, ops) in enumerate(lane_rows, start=num_devices):
        for op in ops:
            ax.broken_barh(
                [(op.start, op.end - op.start)],
                (row - 0.4, 0.8),
                facecolors=LANE_COLORS[op.kind.value],
                edgecolors="white",
                linewidth=0.3,
            )
            ax.text((op.start + op.end) / 2, row, str(op.stage), ha="center", va="center", fontsize=6, color="white")
    if lane_rows:
        total = num_devices + len(lane_rows)
        ax.set_yticks(range(total), [f"d{d}" for d in range(num_devices)] + [label for label, _ in lane_rows])
        ax.set_ylim(total - 0.5, -0.5)


def _lighten(color: str, amount: float) -> str:
    """Later chunks of a device are drawn lighter, so interleaved and V schedules read at a glance."""
    channels = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in channels)


def _draw_memory(ax, timeline: Timeline) -> None:
    cmap = pyplot().get_cmap("viridis")
    num_devices = timeline.num_devices
    for device in range(num_devices):
        points: Sequence[tuple[float, float]] = timeline.memory_curve(device)
        times = [t for t, _ in points] + [timeline.makespan]
        levels = [level for _, level in points] + [points[-1][1]]
        ax.step(
            times, levels, where="post", linewidth=1, color=cmap(device / max(1, num_devices - 1)), label=f"d{device}"
        )
    ax.set_ylabel("memory")
    if num_devices <= 16:
        ax.legend(fontsize=7, ncol=min(num_devices, 8), loc="upper right", frameon=False)
