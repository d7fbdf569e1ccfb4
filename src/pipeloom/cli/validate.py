"""`pipeloom validate FILE`: is this schedule file valid; if not, the grid with the bad ops marked.
`pipeloom validate --torch-csv FILE --placement loop|v`: does torch.distributed.pipelining's CSV
describe a valid schedule whose stages sit where the named placement builds them — checked
before any rank starts, since torch accepts a misplaced CSV and fails at its first step."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pipeloom.cli.parser import EXIT_BAD_INPUT, add_command
from pipeloom.errors import ConfigError, ScheduleError
from pipeloom.ir.io import load_schedule
from pipeloom.ir.torch_csv import PLACEMENTS, check_placement, from_torch_csv, placement_of

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "validate",
        "check a schedule file (or torch's CSV and its placement); print the marked grid if invalid",
        [
            "pipeloom simulate zb-h1 -p 4 -m 8 --export s.json && pipeloom validate s.json",
            "pipeloom validate --torch-csv zbv.csv --placement v",
        ],
    )
    parser.add_argument("file", metavar="FILE", nargs="?", help="a pipeloom.schedule/1 JSON file")
    parser.add_argument(
        "--torch-csv",
        metavar="FILE",
        help="torch.distributed.pipelining's compute-only CSV (one row a rank) instead of FILE",
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        help="with --torch-csv: where the engine builds each stage (loop: stage s on rank s mod p, as for "
        "1F1B, interleaved and ZB-H; v: down the ranks and back, as for ZB-V and DualPipeV); "
        "default: say which one the CSV needs",
    )
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if (args.file is None) == (args.torch_csv is None):
        raise ConfigError("validate: give a schedule FILE or --torch-csv FILE (one of them)")
    if args.placement and not args.torch_csv:
        raise ConfigError("validate: --placement goes with --torch-csv")
    if args.torch_csv:
        return _torch_csv(args.torch_csv, args.placement)
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


def _torch_csv(path: str, placement: str | None) -> int:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read torch CSV {path!r}: {error.strerror}") from None
    schedule = from_torch_csv(text, name=Path(path).stem)
    if placement is None:
        placement = placement_of(schedule)
    else:
        check_placement(schedule, placement)
    print(
        f"{path}: valid on the {placement} placement: {schedule.num_devices} ranks, {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches, {schedule.num_ops} compute actions"
    )
    return 0
