"""How the command line prints: reports, tables, numbers, a progress bar on stderr."""

from __future__ import annotations

import math
import sys

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.sim.simulate import Timeline

__all__ = ["check_finite", "costs_text", "exact_report", "num", "offload_report", "progress_bar", "report", "table"]


def report(timeline: Timeline) -> str:
    s = timeline.schedule
    head = [
        f"schedule     {s.name}: {s.num_devices} devices, {s.num_stages} stages, {s.num_microbatches} micro-batches"
        + (f", {s.num_slices} slices" if s.num_slices > 1 else "")
        + f", {s.num_ops} ops",
        f"costs        {costs_text(timeline.costs)}",
        f"makespan     {num(timeline.makespan)}",
        f"cost         {num(timeline.cost)}  (largest per-device span)",
        f"bubble rate  {timeline.bubble_rate:.2%}",
        "",
    ]
    peaks = timeline.peak_memory  # a derived list: build it once, not per row
    rows = [
        [
            f"d{d}",
            num(timeline.spans[d]),
            num(timeline.useful_time[d]),
            f"{rate:.2%}",
            num(timeline.static_memory[d]),
            num(timeline.peak_activation_memory[d]),
            num(peaks[d]),
        ]
        for d, rate in enumerate(timeline.device_bubble_rates())
    ]
    return "\n".join(head) + table(["device", "span", "useful", "idle", "static", "peak act.", "peak memory"], rows)


def exact_report(exact) -> str:
    hint = f", heuristic {num(exact.hint_cost)}" if exact.hint_cost is not None else ""
    return (
        f"\nexact (CP-SAT, {exact.status.lower()}, {exact.wall_time:.1f} s): cost {num(exact.cost)}{hint}, "
        f"lower bound {num(exact.bound)}, gap {exact.gap:.2%}"
    )


def offload_report(offload) -> str:
    plan = offload.plan
    saved = offload.static_memory_saved
    bits = "" if plan.reload_bits == 16 else f", reloads at {plan.reload_bits} bits"
    return (
        f"\nT-Offload    stages {','.join(map(str, plan.stages))}{bits}\n"
        f"step time    {num(offload.step_time)} (without offload {num(offload.baseline.makespan)}, "
        f"delay {num(offload.delay)})\n"
        f"overlap      {offload.overlap_fraction:.2%} of the copy and host work inside bubbles, "
        f"{offload.on_time_fraction:.2%} before its deadline\n"
        f"{_tightest_windows(offload)}"
        f"static saved {' '.join(num(value) for value in saved)} (per device; static now "
        f"{' '.join(num(value) for value in offload.static_memory)})"
    )


def _tightest_windows(offload) -> str:
    """The offloaded stage whose bubbles are smallest, for the reload and for the offload."""
    if not offload.windows:
        return ""
    reload = min(offload.windows, key=lambda w: w.reload)
    gone = min(offload.windows, key=lambda w: w.offload)
    return (
        f"bubbles      smallest: {num(reload.reload)} idle before stage {reload.stage}'s first forward on "
        f"d{reload.device} (for its reload), {num(gone.offload)} after stage {gone.stage}'s last backward on "
        f"d{gone.device} (for its offload and host step)\n"
    )


def progress_bar(what: str):
    """A one-line progress report on stderr, only when stderr is a terminal."""
    if not sys.stderr.isatty():
        return None

    def report(done: int, total: int) -> None:
        width = 30
        filled = width * done // total
        end = "\n" if done == total else ""
        print(f"\r{what} [{'#' * filled}{'.' * (width - filled)}] {done}/{total}", end=end, file=sys.stderr, flush=True)

    return report


def costs_text(costs: Costs) -> str:
    return ", ".join(f"{key}={value}" for key, value in costs.to_dict().items())


def num(value: float) -> str:
    return f"{value:.6g}"


def table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def check_finite(timeline):
    """Refuse results that overflowed (costs near the float range give an infinite makespan)."""
    figures = [timeline.makespan, timeline.bubble_rate, *timeline.peak_memory]
    if not all(math.isfinite(x) for x in figures):
        raise ConfigError(
            f"{timeline.schedule.name!r}: the costs overflow — makespan {timeline.makespan}, bubble {timeline.bubble_rate}; "
            "scale them down (only their ratios matter)"
        )
    return timeline
