"""How the command line prints and writes: reports, tables, numbers, files, progress on stderr."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from contextlib import contextmanager
from pathlib import Path

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.files import check_writable
from pipeloom.ir.torch_csv import to_torch_csv
from pipeloom.sim.simulate import Timeline
from pipeloom.units import format_time, memory_scale, memory_unit, time_unit
from pipeloom.viz.plot import check_plot_path, plot_timeline, pyplot  # imports matplotlib only when it draws
from pipeloom.viz.trace import write_chrome_trace

__all__ = [
    "check_finite",
    "check_outputs",
    "costs_text",
    "exact_report",
    "num",
    "offload_report",
    "progress_bar",
    "still_working",
    "add_quiet",
    "clock_bar",
    "report",
    "table",
    "write_outputs",
]


def report(timeline: Timeline) -> str:
    """The summary and one row per device, every figure with its unit (`pipeloom.units`)."""
    s, costs = timeline.schedule, timeline.costs
    unit = time_unit(costs)
    peaks = timeline.peak_memory  # a derived list: build it once, not per row
    memory = memory_scale(costs, peaks)
    head = [
        f"schedule     {s.name}: {s.num_devices} devices, {s.num_stages} stages, {s.num_microbatches} micro-batches"
        + (f", {s.num_slices} slices" if s.num_slices > 1 else "")
        + f", {s.num_ops} ops",
        f"costs        {costs_text(costs)}",
        f"makespan     {format_time(timeline.makespan, costs)}  (first op's start to last op's end)",
        f"cost         {format_time(timeline.cost, costs)}  (the longest device span: what a step takes)",
        f"bubble rate  {timeline.bubble_rate:.2%}  (cost minus the mean device's useful work F, B, W, over the cost)",
        f"peak memory  {memory.text(max(peaks))}  (static plus activations, on the fullest device)",
        "",
    ]
    rows = [
        [
            f"d{d}",
            num(timeline.spans[d]),
            num(timeline.useful_time[d]),
            f"{idle:.2%}",
            memory.number(timeline.static_memory[d]),
            memory.number(timeline.peak_activation_memory[d]),
            memory.number(peaks[d]),
        ]
        for d, idle in enumerate(timeline.device_idle_shares())
    ]
    headers = [
        "device",
        f"span ({unit})",
        f"useful ({unit})",
        "idle in span",
        f"static ({memory.unit})",
        f"peak act. ({memory.unit})",
        f"peak memory ({memory.unit})",
    ]
    return "\n".join(head) + table(headers, rows)


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


def progress_bar(what: str, quiet: bool = False, unit: str = "it"):
    """A live tqdm bar on stderr for `progress(done, total)` callbacks; off a terminal (a log, a
    pipe) a plain line at most every 30 s once the work has run 10 s, so a long command is never
    silent; none with --quiet."""
    if quiet:
        return None
    if not sys.stderr.isatty():
        return _progress_lines(what, unit)
    from tqdm import tqdm

    bar = None

    def report(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=what, unit=unit, file=sys.stderr, leave=False, dynamic_ncols=True)
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return report


def _progress_lines(what: str, unit: str, first_s: float = 10.0, every_s: float = 30.0):
    import time

    started = time.monotonic()
    next_line = started + first_s

    def report(done: int, total: int) -> None:
        nonlocal next_line
        now = time.monotonic()
        if now >= next_line and done < total:
            print(
                f"pipeloom {what}: {done:,} of {total:,} {unit}s after {now - started:.0f} s",
                file=sys.stderr,
                flush=True,
            )
            next_line = now + every_s

    return report


@contextmanager
def still_working(what: str, quiet: bool = False, after_s: float = 5.0, every_s: float = 30.0):
    """For work with no natural count (one large schedule built or simulated): if it runs past
    `after_s`, say what it is on stderr, and again every `every_s`, so no command sits silent."""
    import threading
    import time

    if quiet:
        yield
        return
    done, started = threading.Event(), time.monotonic()

    def speak() -> None:
        wait = after_s
        while not done.wait(wait):
            print(
                f"pipeloom: {what}: still working after {time.monotonic() - started:.0f} s", file=sys.stderr, flush=True
            )
            wait = every_s

    speaker = threading.Thread(target=speak, daemon=True)
    speaker.start()
    try:
        yield
    finally:
        done.set()
        speaker.join()


def clock_bar(what: str, seconds: float, quiet: bool = False):
    """A live bar over a time limit for `progress(elapsed, best)` callbacks (a solver that runs
    until its limit), with the best value found so far; none off a terminal or with --quiet."""
    if quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return _ClockBar(
        tqdm(total=round(seconds, 1), desc=what, unit="s", file=sys.stderr, leave=False, bar_format=_CLOCK_FORMAT)
    )


class _ClockBar:
    def __init__(self, bar) -> None:
        self.bar = bar

    def __call__(self, elapsed: float, best: float | None) -> None:
        self.bar.n = min(round(elapsed, 1), self.bar.total)
        if best is not None:
            self.bar.set_postfix_str(f"best makespan {best:.6g}", refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


_CLOCK_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n:.1f}/{total:.1f} s{postfix}"


def add_quiet(parser) -> None:
    parser.add_argument(
        "--quiet", action="store_true", help="no live progress on stderr (it is off when not a terminal)"
    )


def costs_text(costs: Costs) -> str:
    """The costs' keys, then their units: bare costs say they have none."""
    keys = {key: value for key, value in costs.to_dict().items() if key not in ("time_unit", "memory_unit")}
    units = f"  [time in {time_unit(costs)}, memory in {memory_unit(costs)}]"
    return ", ".join(f"{key}={value}" for key, value in keys.items()) + units


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


def check_outputs(paths: list[str | None], plot: str | None) -> None:
    """Refuse unwritable destinations before computing anything, so bad input writes nothing."""
    check_writable(*paths)
    if plot:
        check_plot_path(plot)
        pyplot()  # refuse now if matplotlib is missing, not after the work


def write_outputs(
    timeline: Timeline, export: str | None, trace: str | None, plot: str | None, lanes: Sequence | None = None
) -> None:
    """--export (JSON, or torch's CSV for .csv), --trace and --plot of one timeline."""
    torch_csv = to_torch_csv(timeline.schedule) if export and export.endswith(".csv") else None  # may refuse
    if plot:
        plot_timeline(timeline, plot, lanes=lanes)  # first: the only output with an optional dependency
    if torch_csv is not None and export:
        Path(export).write_text(torch_csv)  # torch.distributed.pipelining's format
    elif export:
        timeline.schedule.to_json(export)
    if trace:
        write_chrome_trace(timeline, trace, lanes=lanes or ())
