"""The parser every command hangs from: errors as one line, help that ends with examples."""

from __future__ import annotations

import argparse
from typing import NoReturn

from pipeloom.errors import ConfigError

__all__ = ["EXIT_BAD_INPUT", "Parser", "add_command"]

EXIT_BAD_INPUT = 2


class Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line like every other error."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}")


def add_command(commands, name: str, summary: str, examples: list[str]) -> Parser:
    """A subcommand whose `--help` ends with a few commands to copy."""
    return commands.add_parser(
        name,
        help=summary,
        description=summary[0].upper() + summary[1:] + ".",
        epilog="examples:\n" + "\n".join(f"  {line}" for line in examples),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
