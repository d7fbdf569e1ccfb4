"""The error hierarchy: every failure pipeloom reports on purpose is a PipeloomError.

Callers (the CLI above all) catch PipeloomError to turn bad input into a one-line message;
anything else escaping is a bug in pipeloom.
"""

from __future__ import annotations

__all__ = ["PipeloomError", "ScheduleError", "ConfigError", "InfeasibleError", "RuntimeFault", "Stopped"]


class PipeloomError(Exception):
    """Base of every error pipeloom raises deliberately."""

    @property
    def summary(self) -> str:
        """The first line of the message: what a CLI prints."""
        text = str(self)
        return text.splitlines()[0] if text else type(self).__name__


class ScheduleError(PipeloomError):
    """A schedule is malformed, incomplete, misplaced or deadlocks.

    `details` holds the rest of the report (for example the device×step grid with the
    offending ops marked), kept apart so that a one-line summary stays one line.
    """

    def __init__(self, message: str, details: str = "") -> None:
        super().__init__(message + ("\n" + details if details else ""))
        self.message = message
        self.details = details

    @property
    def summary(self) -> str:
        return self.message


class ConfigError(PipeloomError, ValueError):
    """An argument is outside the domain of what was asked for (sizes, costs, options)."""


class InfeasibleError(PipeloomError):
    """A request is well-formed but no plan satisfies it (e.g. the memory limit)."""


class RuntimeFault(PipeloomError):
    """The runtime failed while executing a plan (peer died, timeout, mismatch)."""


class Stopped(PipeloomError):
    """A run was stopped by a signal (SIGINT, SIGTERM) and ended every process it started.
    `exit_status` is the shell's convention for it: 128 + the signal's number."""

    def __init__(self, message: str, signal_number: int):
        super().__init__(message)
        self.exit_status = 128 + signal_number
