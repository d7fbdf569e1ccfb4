"""`pipeloom list`: every schedule generator, with what it trades, its paper and how `tune`
searches it (the registry's description, which the tuner itself reads)."""

from __future__ import annotations

import argparse
import json

from pipeloom.cli.output import table
from pipeloom.cli.parser import add_command
from pipeloom.schedules import list_generators

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "list",
        "every schedule generator, with its paper",
        ["pipeloom list", "pipeloom list --json"],
    )
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    generators = list_generators()
    if args.json:
        keys = ("name", "family", "paper", "summary", "domain")
        listing = [
            {key: getattr(g, key) for key in keys} | {"options": list(g.options), "tuned": _tuned(g)}
            for g in generators
        ]
        print(json.dumps(listing, indent=2))
        return 0
    rows = [[g.name, g.summary, g.paper, g.domain, _tuned(g)] for g in generators]
    print(table(["schedule", "what it trades", "paper", "domain", "tune"], rows))
    return 0


def _tuned(generator) -> str:
    """How `tune` searches it (its --schemes name), or why it does not."""
    if generator.tuning is not None:
        return f"as {generator.tuning.scheme}"
    return f"no: {generator.not_tuned}"
