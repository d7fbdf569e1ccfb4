"""`pipeloom simulate`: one schedule (after its passes) — time, memory, bubbles, and files."""

from __future__ import annotations

import argparse
import json

from pipeloom.budget import check_within_budget
from pipeloom.cli.args import (
    add_ckpt,
    add_costs,
    add_schedule_source,
    add_tpipe_passes,
    costs_source,
    mem_limit_from_args,
    schedule_from_args,
)
from pipeloom.cli.output import (
    add_quiet,
    check_finite,
    check_outputs,
    clock_bar,
    exact_report,
    offload_report,
    report,
    write_outputs,
)
from pipeloom.cli.parser import add_command
from pipeloom.cli.passes import offloaded, passes_use_budget, with_passes
from pipeloom.costs import priced
from pipeloom.errors import ConfigError
from pipeloom.sim.simulate import simulate

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "simulate",
        "simulate a schedule: time, memory, bubbles",
        [
            "pipeloom simulate 1f1b -p 4 -m 8",
            "pipeloom simulate zb-v -p 4 -m 8 --costs F=1,B=1,W=1,M_W=0.5 --plot zb-v.png",
            "pipeloom simulate interleaved -p 4 -m 8 -v 2 --ckpt mario --mem-limit 2 --json",
        ],
    )
    add_schedule_source(parser)
    add_costs(parser)
    parser.add_argument(
        "--export",
        metavar="PATH",
        help="write the schedule as pipeloom.schedule/1 JSON, or as torch.distributed.pipelining's CSV (.csv)",
    )
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace JSON of the timeline")
    parser.add_argument("--plot", metavar="PATH", help="draw the timeline and memory curves (.png, .svg, .pdf)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="re-order the schedule's F/B/W optimally with OR-Tools CP-SAT (small p·m), warm-started from it; "
        "memory limit: --mem-limit, else the schedule's own peaks",
    )
    parser.add_argument("--time-limit", type=float, metavar="S", help="seconds for --exact (default 10)")
    add_quiet(parser)
    add_ckpt(parser)
    add_tpipe_passes(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_outputs([args.export, args.trace, args.plot], plot=args.plot)
    if args.time_limit is not None and not args.exact:
        raise ConfigError("--time-limit applies to --exact")
    if args.exact and args.ckpt != "none":
        raise ConfigError("--exact orders F, B and W only; it cannot be combined with --ckpt")
    used = args.exact or passes_use_budget(args)
    build = lambda costs: schedule_from_args(args, costs, budget_is_used=used)  # noqa: E731
    schedule, costs = priced(build, costs_source(args))
    exact = None
    if args.exact:
        from pipeloom.tune.exact import optimise_schedule

        time_limit = args.time_limit if args.time_limit is not None else 10.0
        bar = clock_bar("exact", time_limit, args.quiet)
        try:
            exact = optimise_schedule(schedule, costs, mem_limit_from_args(args), time_limit=time_limit, progress=bar)
        finally:
            if bar:
                bar.close()
        schedule = exact.schedule
    schedule = with_passes(schedule, costs, args)
    offload = offloaded(schedule, costs, args)
    timeline = offload.timeline if offload else simulate(schedule, costs)
    check_finite(timeline)
    check_within_budget(
        timeline.peak_activation_memory, mem_limit_from_args(args), f"{schedule.name!r} after its passes"
    )
    write_outputs(timeline, args.export, args.trace, args.plot, lanes=offload.lane_ops if offload else None)
    if args.json:
        summary = timeline.summary()
        if exact is not None:
            summary["exact"] = exact.summary()
        if offload is not None:
            summary["offload"] = offload.summary()
        print(json.dumps(summary, allow_nan=False))
        return 0
    print(report(timeline))
    if exact is not None:
        print(exact_report(exact))
    if offload is not None:
        print(offload_report(offload))
    return 0
