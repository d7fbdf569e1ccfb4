"""`pipeloom pareto`: peak activation memory against bubble, over every generator and budget."""

from __future__ import annotations

import argparse
import json
import sys

from pipeloom.cli.args import add_costs, costs_source
from pipeloom.cli.output import add_quiet, check_outputs, costs_text, num, progress_bar, table
from pipeloom.cli.parser import add_command
from pipeloom.costs import Costs
from pipeloom.tune.pareto import explore_pareto
from pipeloom.units import memory_scale, time_unit

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "pareto",
        "the frontier of peak activation memory vs bubble over generators and memory budgets",
        [
            "pipeloom pareto -p 4 -m 8 --costs F=1,B=1,W=1,M_W=0.5",
            "pipeloom pareto -p 8 -m 24 --costs F=18.5,B=18.1,W=9.3,comm=0.6,M_W=0.37 --frontier-only "
            "--plot frontier.png",
        ],
    )
    parser.add_argument("-p", "--devices", dest="p", type=int, required=True, help="number of devices")
    parser.add_argument("-m", "--microbatches", dest="m", type=int, required=True, help="micro-batches per step")
    add_costs(parser)
    parser.add_argument("--budgets", type=int, default=12, help="memory budgets per budget-driven generator")
    parser.add_argument("--frontier-only", action="store_true", help="list only the frontier's points")
    parser.add_argument("--plot", metavar="PATH", help="draw the points and the frontier (.png, .svg, .pdf)")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    add_quiet(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    check_outputs([args.plot], plot=args.plot)
    source = costs_source(args)  # Costs, or a profile priced for each schedule's stages
    skipped: list[tuple[str, str]] = []
    points = explore_pareto(
        args.p,
        args.m,
        source,
        budgets=args.budgets,
        progress=progress_bar("pareto", args.quiet, "schedule"),
        skipped=skipped,
    )
    for label, reason in skipped:
        print(f"pipeloom: pareto: left out {label}: {reason}", file=sys.stderr)
    costs = source if isinstance(source, Costs) else None  # a profile's: each point's own (all in bytes)
    if args.plot:
        from pipeloom.viz.pareto_plot import plot_pareto

        plot_pareto(points, args.plot, costs, title=f"p={args.p}, m={args.m}: peak activation memory vs bubble")
    if args.json:
        print(json.dumps([point.to_dict() for point in points], allow_nan=False))
        return 0
    priced = costs or _priced_by(points)
    memory = memory_scale(priced, [q.peak_memory for q in points])
    rows = [
        [_mark(q), q.label, memory.number(q.peak_memory), f"{q.bubble_rate:.2%}", "-" if q.reference else num(q.cost)]
        for q in points
        if q.on_frontier or q.reference or not args.frontier_only
    ]
    legend = "* = on the frontier" + (
        "; a = the authors' schedule (their code), for reference" if any(q.reference for q in points) else ""
    )
    described = (
        costs_text(costs) if costs else f"profile {args.costs} (its layers split evenly over each schedule's stages)"
    )
    print(f"p={args.p} m={args.m} costs: {described}   ({legend})")
    print(table(["", "schedule", f"peak act. ({memory.unit})", "bubble", f"cost ({time_unit(priced)})"], rows))
    return 0


def _priced_by(points) -> Costs:
    """Any point's costs (a profile prices every schedule in ms and bytes alike)."""
    return next((q.timeline.costs for q in points if q.timeline is not None), Costs())


def _mark(point) -> str:
    return "a" if point.reference else "*" if point.on_frontier else ""
