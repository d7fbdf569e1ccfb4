"""A run owns its output directories: one training at a time in each, never mixed with another
run's files, and no half-written checkpoint left behind.

Two runs given the same `--save` both exited 0 and wrote their steps into one directory, so a
later `--resume` picked up whichever wrote last; a later run into a finished run's directory
overwrote its `step-N` and left both runs' checkpoints side by side; two runs appended into one
`metrics.jsonl` and one TensorBoard run. So a run

- holds an exclusive lock on `DIR/.lock` for its whole length (the kernel drops it if the
  process dies, so a crash never leaves the directory locked), for `--save` and `--log-dir`;
- claims each directory by writing its run's identity into `DIR/.run`. A resumed run carries
  the identity of the run it resumes (read beside the checkpoint), so it goes on writing into
  that run's directories; any other run finding another run's files there (checkpoints, metrics,
  TensorBoard events) is refused in one line, unless it starts over (`force`), which first moves
  those files into a sibling `DIR.replaced-N` — never mixed, never deleted.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = ["LOCK_FILE", "OWNER_FILE", "RunIdentity", "remove_partials", "run_outputs", "save_lock", "spec_outputs"]

LOCK_FILE = ".lock"
OWNER_FILE = ".run"
_RUN_FILES = ("step-*", "metrics.jsonl", "events.out.tfevents.*", "wandb")
"""What a run leaves in its directories: checkpoints, metrics, TensorBoard events, W&B's files."""
_HELD: dict[Path, int] = {}
"""The directories this process holds, and how many blocks hold each: a caller that holds a run's
directories (the CLI, printing its header inside) and the launcher it then calls hold them once."""


@dataclass(frozen=True)
class RunIdentity:
    """Which run wrote a directory's files: an id of its own, and what a user recognises it by."""

    run: str
    what: str
    started: str

    @staticmethod
    def new(what: str) -> RunIdentity:
        return RunIdentity(uuid.uuid4().hex, what, time.strftime("%Y-%m-%d %H:%M:%S"))

    @staticmethod
    def read(directory: Path) -> RunIdentity | None:
        try:
            record = json.loads((directory / OWNER_FILE).read_text())
            return RunIdentity(str(record["run"]), str(record["what"]), str(record["started"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, directory: Path) -> None:
        (directory / OWNER_FILE).write_text(json.dumps(self.__dict__))

    def __str__(self) -> str:
        return f"{self.what}, started {self.started}"


@contextmanager
def run_outputs(
    save_dir: str | os.PathLike[str] | None,
    log_dir: str | os.PathLike[str] | None,
    resume_from: str | os.PathLike[str] | None = None,
    force: bool = False,
    what: str = "a training run",
) -> Iterator[None]:
    """Hold and claim a run's output directories — the checkpoints' and the logs' (one directory
    for both is held once) — for the block. `resume_from`: the checkpoint this run continues,
    whose run's directories it may go on writing into. `force`: move another run's files aside
    instead of refusing. `what`: how another run's refusal will name this one."""
    directories = [(Path(save_dir), "--save")] if save_dir is not None else []
    if log_dir is not None and (save_dir is None or Path(save_dir).resolve() != Path(log_dir).resolve()):
        directories.append((Path(log_dir), "--log-dir"))
    continued = _continued_directory(resume_from)
    identity = (RunIdentity.read(continued) if continued is not None else None) or RunIdentity.new(what)
    created = [_first_missing(directory) for directory, _ in directories if not directory.exists()]
    with ExitStack() as held:
        try:
            for directory, flag in directories:
                if held.enter_context(save_lock(directory, flag)):
                    _claim(directory, flag, identity, continued, force)
        except ConfigError:  # a refused run leaves no directory behind: none it made, however far it got
            held.close()
            for top in created:
                if all(entry.name in (LOCK_FILE, OWNER_FILE) for entry in top.rglob("*") if not entry.is_dir()):
                    shutil.rmtree(top, ignore_errors=True)
            raise
        yield


def spec_outputs(spec):
    """`run_outputs` of a `TrainSpec`: its checkpoint and log directories, the checkpoint it
    resumes, whether it starts over; named by its model, seed and schedule."""
    config = spec.run_config or {}
    model = config.get("model") or (spec.resolved_workload().description or {}).get("kind", "built-in decoder")
    what = f"model {model}, seed {spec.seed}, {spec.schedule.name}, pid {os.getpid()}"
    checkpoints = spec.checkpoints
    return run_outputs(spec.save_dir, spec.log_dir, checkpoints.resume_from, checkpoints.force, what)


@contextmanager
def save_lock(directory: str | os.PathLike[str] | None, flag: str = "--save") -> Iterator[bool]:
    """Hold `directory`'s lock for the block (nothing to hold without a directory); ConfigError
    at once, naming the holder, if another process holds it. Yields whether this block took the
    lock (False: no directory, or an enclosing block of this process holds it)."""
    if directory is None:
        yield False
        return
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    key = path.resolve()
    if key in _HELD:
        _HELD[key] += 1
        try:
            yield False
        finally:
            _HELD[key] -= 1
        return
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
    _HELD[key] = 1
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        remove_partials(path)  # an interrupted run's, now that no run writes here
        yield True
    finally:
        del _HELD[key]
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()


def remove_partials(directory: str | os.PathLike[str] | None) -> None:
    """Delete `step-N.partial` directories: checkpoints whose write was interrupted (a complete
    one is renamed to `step-N` by its last act), which nothing can resume from."""
    if directory is None or not Path(directory).is_dir():
        return
    for entry in Path(directory).glob("step-*.partial"):
        shutil.rmtree(entry, ignore_errors=True)


def _first_missing(directory: Path) -> Path:
    """The outermost directory that making `directory` creates."""
    while not directory.parent.exists():
        directory = directory.parent
    return directory


def _continued_directory(resume_from: str | os.PathLike[str] | None) -> Path | None:
    """The directory of the run a resume continues: the one holding its `step-N` checkpoint."""
    if resume_from is None:
        return None
    path = Path(resume_from)
    return path.parent if path.name.startswith("step-") else path


def _claim(directory: Path, flag: str, identity: RunIdentity, continued: Path | None, force: bool) -> None:
    owner = RunIdentity.read(directory)
    files = sorted({entry for pattern in _RUN_FILES for entry in directory.glob(pattern)})
    ours = (owner is not None and owner.run == identity.run) or (
        continued is not None and continued.resolve() == directory.resolve()
    )
    if files and not ours:
        if not force:
            whose = f"another run's files ({owner})" if owner is not None else "another run's files"
            shown = ", ".join(entry.name for entry in files[:3]) + (", ..." if len(files) > 3 else "")
            resume = f"--resume {str(directory)!r}" if flag == "--save" else "--resume from its checkpoints"
            raise ConfigError(
                f"{flag} {str(directory)!r} holds {whose}: {shown}; continue that run with {resume}, start over "
                f"with --force (its files move to {directory.name}.replaced-N), or give another directory"
            )
        aside = _free_sibling(directory)
        aside.mkdir()
        for entry in files + ([directory / OWNER_FILE] if owner is not None else []):
            entry.rename(aside / entry.name)
    identity.write(directory)


def _free_sibling(directory: Path) -> Path:
    n = 1
    while (candidate := directory.with_name(f"{directory.name}.replaced-{n}")).exists():
        n += 1
    return candidate
