"""One training at a time per checkpoint directory, and no half-written checkpoint left in it.

Two runs given the same `--save` both exited 0 and wrote their steps into one directory, so a
later `--resume` picked up whichever wrote last. The launcher holds an exclusive lock on
`DIR/.lock` for the whole run; the kernel drops it if the process dies, so a crash never
leaves the directory locked.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = ["LOCK_FILE", "remove_partials", "run_locks", "save_lock"]

LOCK_FILE = ".lock"


@contextmanager
def run_locks(save_dir: str | os.PathLike[str] | None, log_dir: str | os.PathLike[str] | None) -> Iterator[None]:
    """A run's output directories, each held for the block: the checkpoints' and the logs' (two
    runs appended into one `metrics.jsonl` and one TensorBoard run). One directory for both is
    held once."""
    same = save_dir is not None and log_dir is not None and Path(save_dir).resolve() == Path(log_dir).resolve()
    with save_lock(save_dir), save_lock(None if same else log_dir, "--log-dir"):
        yield


@contextmanager
def save_lock(directory: str | os.PathLike[str] | None, flag: str = "--save") -> Iterator[None]:
    """Hold `directory`'s lock for the block (nothing to hold without a directory); ConfigError
    at once, naming the holder, if another process holds it."""
    if directory is None:
        yield
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    handle = open(path / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"{flag} {str(directory)!r} is in use by another training ({holder}): give another directory, "
            "or wait for that run to end"
        ) from None
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        remove_partials(path)  # an interrupted run's, now that no run writes here
        yield
    finally:
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def remove_partials(directory: str | os.PathLike[str] | None) -> None:
    """Delete `step-N.partial` directories: checkpoints whose write was interrupted (a complete
    one is renamed to `step-N` by its last act), which nothing can resume from."""
    if directory is None or not Path(directory).is_dir():
        return
    for entry in Path(directory).glob("step-*.partial"):
        shutil.rmtree(entry, ignore_errors=True)
