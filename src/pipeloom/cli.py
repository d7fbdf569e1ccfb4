"""The `pipeloom` command line. It owns all printing; the library only returns values.

Bad input of any kind ends in one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, PipeloomError, ScheduleError
from pipeloom.ir.io import load_schedule
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules import build_schedule, get_generator, list_generators
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.viz.plot import plot_timeline  # imports matplotlib only when it draws
from pipeloom.viz.trace import write_chrome_trace

__all__ = ["main"]

EXIT_BAD_INPUT = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "handler", None):
            parser.print_help()
            return EXIT_BAD_INPUT
        return args.handler(args)
    except PipeloomError as error:
        print(f"pipeloom: error: {error.summary}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except OSError as error:  # an output that cannot be written (permissions, full disk)
        print(f"pipeloom: error: {error.strerror or error}: {error.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


# ---------------------------------------------------------------------------------------------
# Commands


def _cmd_list(args: argparse.Namespace) -> int:
    generators = list_generators()
    if args.json:
        print(
            json.dumps(
                [
                    {
                        "name": g.name,
                        "family": g.family,
                        "paper": g.paper,
                        "summary": g.summary,
                        "domain": g.domain,
                        "options": list(g.options),
                    }
                    for g in generators
                ],
                indent=2,
            )
        )
        return 0
    rows = [[g.name, g.paper, g.domain] for g in generators]
    print(_table(["schedule", "paper", "domain"], rows))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    _check_outputs([args.export, args.trace, args.plot], plot=args.plot)
    schedule = _schedule_from_args(args)
    timeline = simulate(schedule, _costs_from_args(args))
    _write_outputs(timeline, args.export, args.trace, args.plot)
    if args.json:
        print(json.dumps(timeline.summary()))
    else:
        print(_report(timeline))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    schedule = _schedule_from_args(args)
    print(schedule.to_text().rstrip("\n") if args.text else schedule.grid())
    return 0


def _cmd_validate(args: argparse.Namespace) -> int:
    schedule = load_schedule(args.file)
    try:
        schedule.validate()
    except ScheduleError as error:
        print(f"pipeloom: error: {error.message}", file=sys.stderr)
        print(error.details, file=sys.stderr)
        return EXIT_BAD_INPUT
    print(
        f"{args.file}: valid {schedule.name!r}: {schedule.num_devices} devices, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches, {schedule.num_slices} slices, {schedule.num_ops} ops"
    )
    return 0


def _cmd_compare(args: argparse.Namespace) -> int:
    costs = _costs_from_args(args)
    timelines = []
    for name in args.names:
        kwargs = {}
        if args.chunks is not None and "num_chunks" in get_generator(name).options:
            kwargs["num_chunks"] = args.chunks
        timelines.append(simulate(build_schedule(name, args.p, args.m, **kwargs), costs))
    if args.plot_dir:
        directory = Path(args.plot_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for timeline in timelines:
            plot_timeline(timeline, directory / f"{timeline.schedule.name}.png")
    if args.json:
        print(json.dumps([timeline.summary() for timeline in timelines]))
        return 0
    rows = [
        [
            t.schedule.name,
            t.schedule.num_stages,
            _num(t.makespan),
            _num(t.cost),
            f"{t.bubble_rate:.2%}",
            _num(max(t.peak_memory)),
            " ".join(_num(x) for x in t.peak_memory),
        ]
        for t in timelines
    ]
    print(f"p={args.p} m={args.m} costs: {_costs_text(costs)}")
    print(_table(["schedule", "stages", "makespan", "cost", "bubble", "peak mem", "peak memory per device"], rows))
    if args.plot_dir:
        print(f"timelines written to {args.plot_dir}/", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Argument plumbing


def _build_parser() -> _Parser:
    parser = _Parser(prog="pipeloom", description="Plan and simulate pipeline-parallel training schedules.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)

    listing = commands.add_parser("list", help="every schedule generator, with its paper")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=_cmd_list)

    sim = commands.add_parser("simulate", help="simulate a schedule: time, memory, bubbles")
    _add_schedule_source(sim)
    _add_costs(sim)
    sim.add_argument("--export", metavar="PATH", help="write the schedule as pipeloom.schedule/1 JSON")
    sim.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON of the timeline")
    sim.add_argument("--plot", metavar="PATH", help="draw the timeline and memory curves (.png, .svg, .pdf)")
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    sim.set_defaults(handler=_cmd_simulate)

    show = commands.add_parser("show", help="print a schedule's device×step grid (or its text form)")
    _add_schedule_source(show)
    show.add_argument("--text", action="store_true", help="print the round-tripping text form instead")
    show.set_defaults(handler=_cmd_show)

    check = commands.add_parser("validate", help="check a schedule file; print the marked grid if invalid")
    check.add_argument("file", metavar="FILE", help="a pipeloom.schedule/1 JSON file")
    check.set_defaults(handler=_cmd_validate)

    compare = commands.add_parser("compare", help="simulate several schedules side by side")
    compare.add_argument("names", nargs="+", metavar="NAME", help="schedule names (see `pipeloom list`)")
    compare.add_argument("-p", "--devices", dest="p", type=int, required=True, help="number of devices")
    compare.add_argument("-m", "--microbatches", dest="m", type=int, required=True, help="micro-batches per step")
    compare.add_argument("-v", "--chunks", type=int, help="chunks per device, for schedules that take it")
    _add_costs(compare)
    compare.add_argument("--plot-dir", metavar="DIR", help="write one timeline PNG per schedule here")
    compare.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    compare.set_defaults(handler=_cmd_compare)
    return parser


def _add_schedule_source(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", metavar="NAME", help="schedule generator (see `pipeloom list`)")
    parser.add_argument("-p", "--devices", dest="p", type=int, help="number of devices")
    parser.add_argument("-m", "--microbatches", dest="m", type=int, help="micro-batches per step")
    parser.add_argument("-v", "--chunks", type=int, help="chunks (stages) per device, for interleaved")
    parser.add_argument("--schedule-file", metavar="PATH", help="read a pipeloom.schedule/1 JSON file instead")


def _add_costs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--costs",
        metavar="SPEC|FILE",
        help="F=1,B=2,W=0,comm=0 (one device's share per micro-batch) or a JSON file with the Costs keys "
        "(F, B, W, R, comm, M_B, M_W, M_ckpt, M_static; scalars or per-stage lists)",
    )


def _schedule_from_args(args: argparse.Namespace) -> Schedule:
    if args.schedule_file:
        if args.name or args.p is not None or args.m is not None or args.chunks is not None:
            raise ConfigError("give either a schedule NAME with -p/-m[/-v] or --schedule-file, not both")
        schedule = load_schedule(args.schedule_file)
        schedule.validate()
        return schedule
    if not args.name:
        raise ConfigError("name a schedule (see `pipeloom list`) or give --schedule-file")
    if args.p is None or args.m is None:
        raise ConfigError(f"schedule {args.name!r} needs -p (devices) and -m (micro-batches)")
    kwargs = {} if args.chunks is None else {"num_chunks": args.chunks}
    return build_schedule(args.name, args.p, args.m, **kwargs)


def _costs_from_args(args: argparse.Namespace) -> Costs:
    spec = args.costs
    if spec is None:
        return Costs()
    if "=" in spec:
        return Costs.parse(spec)
    return Costs.load(spec)


def _check_outputs(paths: list[str | None], plot: str | None) -> None:
    """Refuse unwritable destinations before computing anything, so bad input writes nothing."""
    for path in filter(None, paths):
        parent = Path(path).resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"cannot write {path!r}: directory {str(parent)!r} does not exist")
    if plot and Path(plot).suffix.lower() not in (".png", ".svg", ".pdf"):
        raise ConfigError(f"cannot plot to {plot!r}: use a .png, .svg or .pdf file name")


def _write_outputs(timeline: Timeline, export: str | None, trace: str | None, plot: str | None) -> None:
    if plot:
        plot_timeline(timeline, plot)  # first: the only output with an optional dependency
    if export:
        timeline.schedule.to_json(export)
    if trace:
        write_chrome_trace(timeline, trace)


# ---------------------------------------------------------------------------------------------
# Formatting


def _report(timeline: Timeline) -> str:
    s = timeline.schedule
    head = [
        f"schedule     {s.name}: {s.num_devices} devices, {s.num_stages} stages, {s.num_microbatches} micro-batches"
        + (f", {s.num_slices} slices" if s.num_slices > 1 else "")
        + f", {s.num_ops} ops",
        f"costs        {_costs_text(timeline.costs)}",
        f"makespan     {_num(timeline.makespan)}",
        f"cost         {_num(timeline.cost)}  (largest per-device span)",
        f"bubble rate  {timeline.bubble_rate:.2%}",
        "",
    ]
    peaks = timeline.peak_memory  # a derived list: build it once, not per row
    rows = [
        [
            f"d{d}",
            _num(timeline.spans[d]),
            _num(timeline.useful_time[d]),
            f"{rate:.2%}",
            _num(timeline.static_memory[d]),
            _num(timeline.peak_activation_memory[d]),
            _num(peaks[d]),
        ]
        for d, rate in enumerate(timeline.device_bubble_rates())
    ]
    return "\n".join(head) + _table(["device", "span", "useful", "idle", "static", "peak act.", "peak memory"], rows)


def _costs_text(costs: Costs) -> str:
    return ", ".join(f"{key}={value}" for key, value in costs.to_dict().items())


def _num(value: float) -> str:
    return f"{value:.6g}"


def _table(headers: list[str], rows: list[list]) -> str:
    cells = [headers] + [[str(cell) for cell in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
