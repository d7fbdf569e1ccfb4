"""Reading the JSON files users hand us, with errors that name the file and say what is wrong."""

from __future__ import annotations

import json
from os import PathLike
from typing import Any

from pipeloom.errors import PipeloomError

__all__ = ["read_json"]


def read_json(path: str | PathLike[str], what: str, error: type[PipeloomError]) -> Any:
    """The parsed contents of `path`, or `error` saying "cannot read <what> file ..." in one line."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except OSError as failure:
        raise error(f"cannot read {what} file {str(path)!r}: {failure.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as failure:
        raise error(f"{what} file {str(path)!r} is not JSON: {failure}") from None
