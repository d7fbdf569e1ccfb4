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

from pipeloom.budget import check_within_budget
from pipeloom.cli_args import (
    add_ckpt,
    add_costs,
    add_mem_limit,
    add_schedule_source,
    add_tpipe_passes,
    costs_from_args,
    mem_limit_from_args,
)
from pipeloom.cli_format import check_finite, costs_text, exact_report, num, offload_report, progress_bar, report, table
from pipeloom.cli_passes import offloaded, passes_use_budget, with_passes
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError, PipeloomError, ScheduleError
from pipeloom.files import check_writable
from pipeloom.ir.io import load_schedule
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.torch_csv import from_torch_csv, to_torch_csv
from pipeloom.passes.offload import LaneOp
from pipeloom.passes.split_backward import split_backward
from pipeloom.schedules import build_schedule, get_generator, list_generators
from pipeloom.sim.simulate import Timeline, simulate
from pipeloom.tune.pareto import explore_pareto
from pipeloom.viz.plot import check_plot_path, plot_timeline, pyplot  # imports matplotlib only when it draws
from pipeloom.viz.trace import write_chrome_trace

__all__ = ["main", "EXIT_BAD_INPUT"]

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
    rows = [[g.name, g.summary, g.paper, g.domain] for g in generators]
    print(table(["schedule", "what it trades", "paper", "domain"], rows))
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    _check_outputs([args.export, args.trace, args.plot], plot=args.plot)
    if args.time_limit is not None and not args.exact:
        raise ConfigError("--time-limit applies to --exact")
    if args.exact and args.ckpt != "none":
        raise ConfigError("--exact orders F, B and W only; it cannot be combined with --ckpt")
    costs = costs_from_args(args)
    schedule = _schedule_from_args(args, costs, budget_is_used=args.exact or passes_use_budget(args))
    exact = None
    if args.exact:
        from pipeloom.tune.exact import optimise_schedule

        exact = optimise_schedule(
            schedule,
            costs,
            mem_limit_from_args(args),
            time_limit=args.time_limit if args.time_limit is not None else 10.0,
        )
        schedule = exact.schedule
    schedule = with_passes(schedule, costs, args)
    offload = offloaded(schedule, costs, args)
    timeline = offload.timeline if offload else simulate(schedule, costs)
    check_finite(timeline)
    check_within_budget(
        timeline.peak_activation_memory, mem_limit_from_args(args), f"{schedule.name!r} after its passes"
    )
    _write_outputs(timeline, args.export, args.trace, args.plot, lanes=offload.lane_ops if offload else None)
    if args.json:
        summary = timeline.summary()
        if exact is not None:
            summary["exact"] = exact.summary()
        if offload is not None:
            summary["offload"] = offload.summary()
        print(json.dumps(summary, allow_nan=False))
    else:
        print(report(timeline))
        if exact is not None:
            print(exact_report(exact))
        if offload is not None:
            print(offload_report(offload))
    return 0


def _cmd_pareto(args: argparse.Namespace) -> int:
    _check_outputs([args.plot], plot=args.plot)
    costs = costs_from_args(args)
    skipped: list[tuple[str, str]] = []
    points = explore_pareto(
        args.p, args.m, costs, budgets=args.budgets, progress=progress_bar("pareto"), skipped=skipped
    )
    for label, reason in skipped:
        print(f"pipeloom: pareto: left out {label}: {reason}", file=sys.stderr)
    if args.plot:
        from pipeloom.viz.pareto_plot import plot_pareto

        plot_pareto(points, args.plot, title=f"p={args.p}, m={args.m}: peak activation memory vs bubble")
    if args.json:
        print(json.dumps([point.to_dict() for point in points], allow_nan=False))
        return 0
    rows = [
        ["*" if q.on_frontier else "", q.label, num(q.peak_memory), f"{q.bubble_rate:.2%}", num(q.cost)]
        for q in points
        if q.on_frontier or not args.frontier_only
    ]
    print(f"p={args.p} m={args.m} costs: {costs_text(costs)}   (* = on the frontier)")
    print(table(["", "schedule", "peak act. mem", "bubble", "cost"], rows))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    schedule = _schedule_from_args(args, costs_from_args(args))
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
    costs = costs_from_args(args)
    budget = mem_limit_from_args(args)
    timelines = []
    for name in args.names:
        options = get_generator(name).options
        kwargs: dict = {}
        if args.chunks is not None and "num_chunks" in options:
            kwargs["num_chunks"] = args.chunks
        if args.slices is not None and "num_slices" in options:
            kwargs["num_slices"] = args.slices
        if "costs" in options:
            kwargs["costs"] = costs
        if budget is not None and "mem_limit" in options:
            kwargs["mem_limit"] = budget
        timelines.append(check_finite(simulate(build_schedule(name, args.p, args.m, **kwargs), costs)))
    if args.plot_dir:
        directory = Path(args.plot_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for timeline in timelines:
            plot_timeline(timeline, directory / f"{timeline.schedule.name}.png")
    if args.json:
        print(json.dumps([timeline.summary() for timeline in timelines], allow_nan=False))
        return 0
    rows = [
        [
            t.schedule.name,
            t.schedule.num_stages,
            num(t.makespan),
            num(t.cost),
            f"{t.bubble_rate:.2%}",
            num(max(t.peak_memory)),
            " ".join(num(x) for x in t.peak_memory),
        ]
        for t in timelines
    ]
    print(f"p={args.p} m={args.m} costs: {costs_text(costs)}")
    print(table(["schedule", "stages", "makespan", "cost", "bubble", "peak mem", "peak memory per device"], rows))
    if args.plot_dir:
        print(f"timelines written to {args.plot_dir}/", file=sys.stderr)
    return 0


# ---------------------------------------------------------------------------------------------
# Argument plumbing


def _build_parser() -> _Parser:
    parser = _Parser(prog="pipeloom", description="Plan, simulate and run pipeline-parallel training schedules.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)

    listing = commands.add_parser("list", help="every schedule generator, with its paper")
    listing.add_argument("--json", action="store_true", help="machine-readable output")
    listing.set_defaults(handler=_cmd_list)

    sim = commands.add_parser("simulate", help="simulate a schedule: time, memory, bubbles")
    add_schedule_source(sim)
    add_costs(sim)
    sim.add_argument(
        "--export",
        metavar="PATH",
        help="write the schedule as pipeloom.schedule/1 JSON, or as torch.distributed.pipelining's CSV (.csv)",
    )
    sim.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON of the timeline")
    sim.add_argument("--plot", metavar="PATH", help="draw the timeline and memory curves (.png, .svg, .pdf)")
    sim.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    sim.add_argument(
        "--exact",
        action="store_true",
        help="re-order the schedule's F/B/W optimally with OR-Tools CP-SAT (small p·m), warm-started from it; "
        "memory limit: --mem-limit, else the schedule's own peaks",
    )
    sim.add_argument("--time-limit", type=float, metavar="S", help="seconds for --exact (default 10)")
    add_ckpt(sim)
    add_tpipe_passes(sim)
    sim.set_defaults(handler=_cmd_simulate)

    pareto = commands.add_parser(
        "pareto", help="the frontier of peak activation memory vs bubble over generators and memory budgets"
    )
    pareto.add_argument("-p", "--devices", dest="p", type=int, required=True, help="number of devices")
    pareto.add_argument("-m", "--microbatches", dest="m", type=int, required=True, help="micro-batches per step")
    add_costs(pareto)
    pareto.add_argument("--budgets", type=int, default=12, help="memory budgets per budget-driven generator")
    pareto.add_argument("--frontier-only", action="store_true", help="list only the frontier's points")
    pareto.add_argument("--plot", metavar="PATH", help="draw the points and the frontier (.png, .svg, .pdf)")
    pareto.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    pareto.set_defaults(handler=_cmd_pareto)

    from pipeloom.cli_tune import add_commands

    add_commands(commands)

    from pipeloom.cli_train import add_train_arguments, cmd_train  # it builds on this module's helpers

    train = commands.add_parser(
        "train", help="train a small LLaMA-style model with a schedule on local ranks (torch, gloo)"
    )
    train.add_argument("--nproc", type=int, help="ranks to start on this machine (= p × dp; with --plan, the plan's)")
    add_train_arguments(train)
    train.set_defaults(handler=cmd_train)

    show = commands.add_parser("show", help="print a schedule's device×step grid (or its text form)")
    add_schedule_source(show)
    add_costs(show)
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
    compare.add_argument("--slices", type=int, help="slices per micro-batch, for schedules that take it")
    add_costs(compare)
    add_mem_limit(compare)
    compare.add_argument("--plot-dir", metavar="DIR", help="write one timeline PNG per schedule here")
    compare.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    compare.set_defaults(handler=_cmd_compare)
    return parser


def _schedule_from_args(args: argparse.Namespace, costs: Costs, budget_is_used: bool = False) -> Schedule:
    """The named (or loaded) schedule, with --split applied; generators that take costs get them."""
    if args.batch_w and args.split not in ("deferred", "fill"):
        raise ConfigError("--batch-w needs --split deferred or --split fill")
    budget = mem_limit_from_args(args)
    if args.schedule_file:
        if args.name or args.p is not None or args.m is not None or _generator_flags(args):
            raise ConfigError(
                "give either a schedule NAME with -p/-m[/-v/--slices/--forwards] or --schedule-file, not both"
            )
        if budget is not None and not budget_is_used:
            raise ConfigError(
                "--mem-limit applies to memory-aware generators (zb-auto, v-auto), --ckpt mario or --exact"
            )
        schedule = _load_schedule_file(args.schedule_file)
    else:
        if not args.name:
            raise ConfigError("name a schedule (see `pipeloom list`) or give --schedule-file")
        if args.p is None or args.m is None:
            raise ConfigError(f"schedule {args.name!r} needs -p (devices) and -m (micro-batches)")
        options = get_generator(args.name).options
        kwargs: dict = _generator_flags(args)
        for flag, option in (("-v", "num_chunks"), ("--slices", "num_slices"), ("--forwards", "forwards")):
            if option in kwargs and option not in options:
                raise ConfigError(f"schedule {args.name!r} does not take {flag}")
        if "costs" in options:
            kwargs["costs"] = costs
        if budget is not None and "mem_limit" in options:
            kwargs["mem_limit"] = budget
        elif budget is not None and not budget_is_used:
            takers = ", ".join(g.name for g in list_generators() if "mem_limit" in g.options)
            raise ConfigError(f"schedule {args.name!r} takes no memory limit; memory-driven schedules: {takers}")
        schedule = build_schedule(args.name, args.p, args.m, **kwargs)
    if args.split:
        schedule = split_backward(schedule, args.split, costs=costs, batch=args.batch_w)
    return schedule


def _load_schedule_file(path: str) -> Schedule:
    """A pipeloom.schedule/1 JSON file, or torch.distributed.pipelining's CSV (.csv), validated."""
    if not path.endswith(".csv"):
        return load_schedule(path).validate()
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read schedule file {path!r}: {error.strerror}") from None
    return from_torch_csv(text, name=Path(path).stem)


def _generator_flags(args: argparse.Namespace) -> dict:
    """The generator options given on the command line (-v, --slices, --forwards)."""
    given = {"num_chunks": args.chunks, "num_slices": args.slices, "forwards": args.forwards}
    return {option: value for option, value in given.items() if value is not None}


def _check_outputs(paths: list[str | None], plot: str | None) -> None:
    """Refuse unwritable destinations before computing anything, so bad input writes nothing."""
    check_writable(*paths)
    if plot:
        check_plot_path(plot)
        pyplot()  # refuse now if matplotlib is missing, not after the work


def _write_outputs(
    timeline: Timeline, export: str | None, trace: str | None, plot: str | None, lanes: Sequence[LaneOp] | None = None
) -> None:
    torch_csv = to_torch_csv(timeline.schedule) if export and export.endswith(".csv") else None  # may refuse
    if plot:
        plot_timeline(timeline, plot, lanes=lanes)  # first: the only output with an optional dependency
    if torch_csv is not None:
        Path(export).write_text(torch_csv)  # torch.distributed.pipelining's format
    elif export:
        timeline.schedule.to_json(export)
    if trace:
        write_chrome_trace(timeline, trace, lanes=lanes or ())


if __name__ == "__main__":
    sys.exit(main())
