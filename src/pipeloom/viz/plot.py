"""Timeline picture: one row of op boxes per device, the memory curve of every device under it.

matplotlib is imported here, lazily, so the planning core never pays for it; install it with
``pip install 'pipeloom[plot]'``. The output format follows the file extension (png, svg, pdf).
Every axis carries the costs' units (`pipeloom.units`), and legends sit outside the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from os import PathLike
from pathlib import Path

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import OpKind
from pipeloom.sim.simulate import Timeline
from pipeloom.units import memory_scale, time_unit

__all__ = [
    "KIND_COLORS",
    "LEGEND_OUTSIDE",
    "check_plot_path",
    "draw_memory",
    "draw_ops",
    "legend_handles",
    "plot_timeline",
    "pyplot",
    "save_figure",
    "timeline_figure",
]

KIND_COLORS = {
    OpKind.F: "#4C72B0",
    OpKind.B: "#55A868",
    OpKind.W: "#8172B3",
    OpKind.BW: "#2F8F5B",
    OpKind.R: "#DD8452",
}
KIND_NAMES = {
    OpKind.F: "F forward",
    OpKind.B: "B input gradient",
    OpKind.W: "W weight gradient",
    OpKind.BW: "BW fused backward",
    OpKind.R: "R recompute",
}
LANE_COLORS = {"RELOAD": "#937860", "OFFLOAD": "#C44E52", "HOST_STEP": "#CCB974"}
_CKPT_COLOR = "#9DB4D8"  # a checkpointed forward keeps only its input: drawn paler
_PART_HATCH = "////"  # a W in parts: hatched, so its pieces read as one weight gradient
_MAX_LABELS = 1500
_LABEL_SHARE = 1 / 90  # a box narrower than this share of the time axis gets no label
LEGEND_OUTSIDE = {"loc": "upper left", "bbox_to_anchor": (1.01, 1.0), "frameon": False, "fontsize": 7}


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
    save_figure(timeline_figure(timeline, title, lanes), path)


def save_figure(figure, path: str | PathLike[str]) -> None:
    """Write and release a figure; "tight" keeps the legends placed outside the axes in the file."""
    figure.savefig(path, dpi=120, bbox_inches="tight")
    pyplot().close(figure)


def timeline_figure(timeline: Timeline, title: str | None = None, lanes: Sequence | None = None):
    """The figure `plot_timeline` saves: ops above, memory below, on one time axis."""
    plt = pyplot()
    lane_rows = _lane_rows(lanes or ())
    num_rows = timeline.num_devices + len(lane_rows)
    height = 1.2 + 0.32 * num_rows
    figure, (ops_ax, mem_ax) = plt.subplots(
        2, 1, figsize=(13, height + 2.4), sharex=True, gridspec_kw={"height_ratios": [height, 2.4]}
    )
    draw_ops(ops_ax, timeline)
    _draw_lanes(ops_ax, timeline.num_devices, lane_rows)
    draw_memory(mem_ax, timeline)
    costs = timeline.costs
    memory = memory_scale(costs, timeline.peak_memory)
    schedule = timeline.schedule
    unit = time_unit(costs)
    lanes_end = f", lanes end {max(op.end for _, ops in lane_rows for op in ops):.4g} {unit}" if lane_rows else ""
    ops_ax.set_title(
        title
        or f"{schedule.name}: p={schedule.num_devices} m={schedule.num_microbatches} S={schedule.num_stages}"
        + (f" slices={schedule.num_slices}" if schedule.num_slices > 1 else "")
        + f" — makespan {timeline.makespan:.4g} {unit}, bubble {timeline.bubble_rate:.1%}, "
        f"peak memory {memory.text(max(timeline.peak_memory))}{lanes_end}",
        loc="left",
        fontsize=10,
    )
    ops_ax.legend(handles=legend_handles(timeline, lane_rows), title="ops", **LEGEND_OUTSIDE)
    mem_ax.set_xlabel(f"time ({unit})")
    figure.tight_layout()
    return figure


def legend_handles(timeline: Timeline, lane_rows: Sequence = ()) -> list:
    """One entry per thing the picture draws: op kinds, checkpointed forwards, later chunks,
    W parts, overlapped pairs, slice labels and offload lanes — only those present."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ops = [op for device_ops in timeline.schedule.devices for op in device_ops]
    kinds = sorted({op.kind for op in ops}, key=list(KIND_COLORS).index)
    handles: list[Patch | Line2D] = [Patch(color=KIND_COLORS[kind], label=KIND_NAMES[kind]) for kind in kinds]
    if any(op.ckpt for op in ops):
        handles.append(Patch(color=_CKPT_COLOR, label="F checkpointed (keeps its input)"))
    chunks = max(len(timeline.schedule.stages_on(d)) for d in range(timeline.num_devices))
    for chunk in range(1, chunks):
        handles.append(
            Patch(color=_lighten(KIND_COLORS[OpKind.F], _chunk_shade(chunk, chunks)), label=f"chunk {chunk} (paler)")
        )
    if any(op.parts > 1 for op in ops if op.kind is OpKind.W):
        handles.append(Patch(facecolor=KIND_COLORS[OpKind.W], hatch=_PART_HATCH, edgecolor="white", label="W part"))
    if any(op.overlap_next for op in ops):
        handles.append(Patch(facecolor="none", edgecolor="black", label="F&B overlapped pair"))
    if timeline.schedule.num_slices > 1:
        handles.append(
            Line2D([], [], linestyle="none", marker="$m.s$", color="black", markersize=12, label="micro-batch.slice")
        )
    else:
        handles.append(Line2D([], [], linestyle="none", marker="$m$", color="black", label="micro-batch"))
    lane_kinds = sorted({op.kind.value for _, lane_ops in lane_rows for op in lane_ops}, key=list(LANE_COLORS).index)
    handles += [Patch(color=LANE_COLORS[kind], label=f"{kind} (lane)") for kind in lane_kinds]
    return handles


def draw_ops(ax, timeline: Timeline, label_share: float = _LABEL_SHARE) -> None:
    """One row per device. Boxes wide enough carry their micro-batch (micro-batch.slice with
    slices); narrower ones of one colour that touch merge into a shaded band, without the white
    edges that would otherwise turn a slice-level timeline into stripes."""
    num_devices = timeline.num_devices
    label = timeline.graph.num_ops <= _MAX_LABELS
    labels: dict[tuple[str, int], list[tuple[float, float]]] = {}  # (text, font size): where
    sliced = timeline.schedule.num_slices > 1
    wide = timeline.makespan * label_share if timeline.makespan else 0
    for device in range(num_devices):
        stages = timeline.schedule.stages_on(device)
        chunk_of = {stage: i for i, stage in enumerate(stages)}
        boxes: dict[tuple[str, float, float, bool, bool], list[tuple[float, float]]] = {}
        paired: list[tuple[float, float]] = []
        in_pair = False  # the previous op overlaps this one: an F&B pair shares one cell, top and bottom
        for timing in timeline.timings(device):
            op = timing.op
            color = _CKPT_COLOR if op.ckpt else KIND_COLORS[op.kind]
            color = _lighten(color, _chunk_shade(chunk_of.get(op.stage, 0), len(stages)))
            width = timing.end - timing.start
            bottom, height = (device, 0.4) if in_pair else (device - 0.4, 0.4 if op.overlap_next else 0.8)
            if op.overlap_next:
                paired.append((timing.start, width))
            in_pair = op.overlap_next
            hatched = op.kind is OpKind.W and op.parts > 1
            narrow = width < wide
            spans = boxes.setdefault((color, bottom, height, hatched, narrow), [])
            if narrow and spans and abs(spans[-1][0] + spans[-1][1] - timing.start) <= 1e-9 * wide:
                spans[-1] = (spans[-1][0], spans[-1][1] + width)  # touching narrow boxes: one band
            else:
                spans.append((timing.start, width))
            if label and width >= wide:
                text = f"{op.microbatch}.{op.slice}" if sliced else str(op.microbatch)
                at = labels.setdefault((text, 6 if height > 0.5 else 4), [])
                at.append((timing.start + width / 2, bottom + height / 2))
        for (color, bottom, height, hatched, narrow), spans in boxes.items():
            ax.broken_barh(
                spans,
                (bottom, height),
                facecolors=color,
                edgecolors=color if narrow else "white",  # white edges on slivers would be all one sees
                linewidth=0 if narrow else 0.3,
                hatch=_PART_HATCH if hatched else None,
            )
        if paired:
            ax.broken_barh(paired, (device - 0.4, 0.8), facecolors="none", edgecolors="black", linewidth=0.8)
    for (text, size), points in labels.items():
        _draw_labels(ax, text, size, points)
    ax.set_yticks(range(num_devices), [f"d{d}" for d in range(num_devices)])
    ax.set_ylim(num_devices - 0.5, -0.5)
    ax.set_ylabel("device")


def _draw_labels(ax, text: str, size: int, points: list[tuple[float, float]]) -> None:
    """`text` in white at each point, as one marker drawn many times: a text artist per box
    took most of a timeline's drawing. A marker's larger side spans its size, so the size is
    what that side of the text takes at `size` points (a digit is about 0.73 em high, 0.55 em wide)."""
    xs, ys = zip(*points)
    side = size * max(0.73, 0.55 * len(text))
    ax.scatter(xs, ys, s=side**2, marker=f"${text}$", c="white", linewidths=0, zorder=3)


def draw_memory(
    ax, timeline: Timeline, devices: Sequence[int] | None = None, label_prefix: str = "", color=None
) -> None:
    """Memory over time (static included) of each device, in the costs' unit, legend outside."""
    cmap = pyplot().get_cmap("viridis")
    num_devices = timeline.num_devices
    memory = memory_scale(timeline.costs, timeline.peak_memory)
    for device in devices if devices is not None else range(num_devices):
        points: Sequence[tuple[float, float]] = timeline.memory_curve(device)
        times = [t for t, _ in points] + [timeline.makespan]
        levels = [memory.value(level) for _, level in points] + [memory.value(points[-1][1])]
        ax.step(
            times,
            levels,
            where="post",
            linewidth=1,
            color=cmap(device / max(1, num_devices - 1)),
            label=f"d{device}",
        )
    ax.set_ylabel(f"memory ({memory.unit})")
    if num_devices <= 16:
        ax.legend(title="device", ncol=1 if num_devices <= 8 else 2, **LEGEND_OUTSIDE)


def _chunk_shade(chunk: int, chunks: int) -> float:
    """How much paler a device's later chunks are, so interleaved and V schedules read at a glance."""
    return 0.45 * chunk / max(1, chunks - 1)


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
    channels = [int(color[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * amount):02x}" for c in channels)
