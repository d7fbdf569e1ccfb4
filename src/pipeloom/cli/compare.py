"""`pipeloom compare`: several schedules on the same sizes and costs, side by side."""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

from pipeloom.cli.args import (
    add_costs,
    add_mem_limit,
    add_schedule_name,
    costs_source,
    generator_options,
    mem_limit_from_args,
    schedule_name,
)
from pipeloom.cli.output import check_finite, check_outputs, costs_text, num, table
from pipeloom.cli.parser import add_command
from pipeloom.costs import Costs, priced
from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules import build_schedule
from pipeloom.sim.simulate import simulate
from pipeloom.units import memory_scale, time_unit
from pipeloom.viz.plot import plot_timeline

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "compare",
        "simulate several schedules side by side",
        [
            "pipeloom compare 1f1b zb-h1 zb-v -p 4 -m 8 --costs F=1,B=1,W=1,M_W=0.5",
            "pipeloom compare --schedule gpipe,1f1b,interleaved -p 4 -m 8 -v 2 --plot compare.png",
        ],
    )
    add_schedule_name(parser, many=True)
    parser.add_argument("-p", "--devices", dest="p", type=int, required=True, help="number of devices")
    parser.add_argument("-m", "--microbatches", dest="m", type=int, required=True, help="micro-batches per step")
    parser.add_argument("-v", "--chunks", type=int, help="chunks per device, for schedules that take it")
    parser.add_argument("--slices", type=int, help="slices per micro-batch, for schedules that take it")
    add_costs(parser)
    add_mem_limit(parser)
    parser.add_argument(
        "--plot", metavar="PATH", help="draw every schedule in one figure on one time axis, memory beneath"
    )
    parser.add_argument("--plot-dir", metavar="DIR", help="also write one timeline PNG per schedule here")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    names = schedule_name(args)
    if not names:
        raise ConfigError("name the schedules to compare (see `pipeloom list`)")
    check_outputs([args.plot], plot=args.plot)
    budget = mem_limit_from_args(args)
    source = costs_source(args)  # Costs, or a profile priced for each schedule's stages
    timelines = []
    for name in names:
        options = generator_options(
            name, "compare builds generators; `pipeloom simulate --schedule-file {name}` reads it"
        )
        kwargs: dict = {}
        if args.chunks is not None and "num_chunks" in options:
            kwargs["num_chunks"] = args.chunks
        if args.slices is not None and "num_slices" in options:
            kwargs["num_slices"] = args.slices
        if budget is not None and "mem_limit" in options:
            kwargs["mem_limit"] = budget
        build = partial(_build, name, args.p, args.m, kwargs, "costs" in options)
        schedule, costs = priced(build, source)
        timelines.append(check_finite(simulate(schedule, costs)))
    if args.plot:
        from pipeloom.viz.compare_plot import plot_comparison

        plot_comparison(timelines, args.plot)
    if args.plot_dir:
        directory = Path(args.plot_dir)
        directory.mkdir(parents=True, exist_ok=True)
        for timeline in timelines:
            plot_timeline(timeline, directory / f"{timeline.schedule.name}.png")
    if args.json:
        print(json.dumps([timeline.summary() for timeline in timelines], allow_nan=False))
        return 0
    unit = time_unit(costs)
    memory = memory_scale(costs, [x for t in timelines for x in t.peak_memory])
    rows = [
        [
            t.schedule.name,
            t.schedule.num_stages,
            num(t.makespan),
            num(t.cost),
            f"{t.bubble_rate:.2%}",
            memory.number(max(t.peak_memory)),
            " ".join(memory.number(x) for x in t.peak_memory),
        ]
        for t in timelines
    ]
    profiled = f"profile {args.costs} (its layers split evenly over each schedule's stages)"
    print(f"p={args.p} m={args.m} costs: {costs_text(source) if isinstance(source, Costs) else profiled}")
    headers = [
        "schedule",
        "stages",
        f"makespan ({unit})",
        f"cost ({unit})",
        "bubble",
        f"peak mem ({memory.unit})",
        f"peak memory per device ({memory.unit})",
    ]
    print(table(headers, rows))
    for path in (args.plot, args.plot_dir and f"{args.plot_dir}/"):
        if path:
            print(f"timelines written to {path}", file=sys.stderr)
    return 0


def _build(name: str, p: int, m: int, kwargs: dict, takes_costs: bool, costs: Costs) -> Schedule:
    """`name`'s schedule, given `costs` where its generator takes them."""
    return build_schedule(name, p, m, **kwargs, **({"costs": costs} if takes_costs else {}))
