"""The `pipeloom` command line: one module per command, each with a `register(commands)` that
adds its parser and handler. The command line owns all printing; the library only returns values.

Bad input of any kind ends in one line on stderr and exit status 2, with nothing written.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Sequence

from pipeloom.cli import compare, export, export_plan, listing, pareto, profile, show, simulate, train, tune, validate
from pipeloom.cli.parser import EXIT_BAD_INPUT, Parser
from pipeloom.errors import PipeloomError, Stopped

__all__ = ["main", "EXIT_BAD_INPUT", "subcommand"]

# in `--help` order
_COMMANDS = (listing, simulate, pareto, profile, tune, train, export, export_plan, show, validate, compare)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(_with_config(parser, list(sys.argv[1:] if argv is None else argv)))
        if not getattr(args, "handler", None):
            parser.print_help()
            return EXIT_BAD_INPUT
        return args.handler(args)
    except Stopped as stop:
        print(f"pipeloom: {stop.summary}", file=sys.stderr)
        return stop.exit_status
    except PipeloomError as error:
        print(f"pipeloom: error: {error.summary}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except BrokenPipeError:
        return 0
    except KeyboardInterrupt:  # Ctrl-C in a command that holds no ranks (train's launcher stops its own)
        print("pipeloom: stopped by SIGINT", file=sys.stderr)
        return 128 + signal.SIGINT
    except OSError as error:  # an output that cannot be written (permissions, full disk)
        print(f"pipeloom: error: {error.strerror or error}: {error.filename or ''}".rstrip(": "), file=sys.stderr)
        return EXIT_BAD_INPUT


def _with_config(parser: Parser, argv: list[str]) -> list[str]:
    """`train --config FILE`: the file's settings as flags before the command line's own."""
    if not argv or argv[0] != "train":
        return argv
    from pipeloom.cli.config_file import expand_config

    return expand_config(argv, subcommand(parser, "train"), 1)


def subcommand(parser: Parser, name: str) -> argparse.ArgumentParser:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices[name]


def build_parser() -> Parser:
    parser = Parser(prog="pipeloom", description="Plan, simulate and run pipeline-parallel training schedules.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=Parser)
    for command in _COMMANDS:
        command.register(commands)
    return parser


if __name__ == "__main__":
    sys.exit(main())
