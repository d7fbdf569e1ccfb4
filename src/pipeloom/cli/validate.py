"""`pipeloom validate FILE`: is this schedule file valid; if not, the grid with the bad ops marked."""

from __future__ import annotations

import argparse
import sys

from pipeloom.cli.parser import EXIT_BAD_INPUT, add_command
from pipeloom.errors import ScheduleError
from pipeloom.ir.io import load_schedule

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "validate",
        "check a schedule file; print the marked grid if invalid",
        ["pipeloom simulate zb-h1 -p 4 -m 8 --export s.json && pipeloom validate s.json"],
    )
    parser.add_argument("file", metavar="FILE", help="a pipeloom.schedule/1 JSON file")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
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
