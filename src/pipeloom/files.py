"""Reading the JSON files users hand us, and checking where we will write, with errors that name
the file and say what is wrong."""

from __future__ import annotations

import json
import os
import tempfile
from os import PathLike
from pathlib import Path
from typing import Any

from pipeloom.errors import ConfigError, PipeloomError

__all__ = ["check_writable", "read_json"]


def read_json(path: str | PathLike[str], what: str, error: type[PipeloomError]) -> Any:
    """The parsed contents of `path`, or `error` saying "cannot read <what> file ..." in one line."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as failure:
        raise error(f"cannot read {what} file {str(path)!r}: {failure.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as failure:
        raise error(f"{what} file {str(path)!r} is not JSON: {failure}") from None


def check_writable(*paths: str | PathLike[str] | None) -> None:
    """Refuse, before any work, a destination that cannot be written: a missing or read-only
    directory, or a path that is a directory."""
    for path in paths:
        if not path:
            continue
        target = Path(path)
        parent = target.resolve().parent
        if not parent.is_dir():
            raise ConfigError(f"cannot write {str(path)!r}: directory {str(parent)!r} does not exist")
        if target.is_dir():
            raise ConfigError(f"cannot write {str(path)!r}: it is a directory; name a file")
        if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
            raise ConfigError(f"cannot write {str(path)!r}: permission denied")


def check_directory_target(path: str | PathLike[str] | None, flag: str) -> None:
    """Refuse, before any rank starts, a directory destination (`--save`, `--log-dir`) that cannot
    be made: the path or one of its parents is a file, or the nearest existing parent is read-only.
    A rank found it out later, and its peers reported only that it had gone."""
    if not path:
        return
    target = Path(path).absolute()
    if target.exists() and not target.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: it is a file, not a directory")
    existing = target
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{flag} {str(path)!r}: {str(existing)!r} is a file, not a directory")
    if not os.access(existing, os.W_OK):
        raise ConfigError(f"{flag} {str(path)!r}: cannot write into {str(existing)!r} (permission denied)")
    try:  # what access() cannot tell: a pseudo filesystem (/proc, /sys) takes no new directory, even from root
        os.rmdir(tempfile.mkdtemp(prefix=".pipeloom-probe-", dir=existing))
    except OSError as error:
        raise ConfigError(
            f"{flag} {str(path)!r}: cannot make a directory in {str(existing)!r} ({error.strerror or error})"
        ) from None
