"""`pipeloom show`: a schedule's device×step grid, or its round-tripping text form."""

from __future__ import annotations

import argparse

from pipeloom.cli.args import add_costs, add_schedule_source, costs_source, schedule_from_args
from pipeloom.cli.parser import add_command
from pipeloom.costs import priced

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "show",
        "print a schedule's device×step grid (or its text form)",
        ["pipeloom show 1f1b -p 4 -m 8", "pipeloom show --schedule zb-v -p 4 -m 8 --text"],
    )
    add_schedule_source(parser)
    add_costs(parser)
    parser.add_argument("--text", action="store_true", help="print the round-tripping text form instead")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    schedule, _ = priced(lambda costs: schedule_from_args(args, costs), costs_source(args))
    print(schedule.to_text().rstrip("\n") if args.text else schedule.grid())
    return 0
