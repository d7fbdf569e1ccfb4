"""A run owns its output directories: one training at a time in each (a lock held by another
process), and no run writes into a directory holding another run's files unless it continues
that run (`--resume`) or starts over (`--force`, which moves them aside)."""

import subprocess
import sys
from contextlib import contextmanager

import pytest

from pipeloom.errors import ConfigError
from pipeloom.runtime.run_outputs import LOCK_FILE, OWNER_FILE, RunIdentity, run_outputs


@contextmanager
def held_by_another_process(directory):
    """`directory`'s lock held by another process (a second training), until the block ends: its
    lock file locked and named as `save_lock` does (without importing torch, which takes seconds)."""
    directory.mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, os, sys\n"
            f"lock = open({str(directory / LOCK_FILE)!r}, 'a+'); fcntl.flock(lock, fcntl.LOCK_EX)\n"
            "lock.truncate(0); lock.write(f'pid {os.getpid()}'); lock.flush()\n"
            "print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        yield holder.pid
    finally:
        holder.stdin.close()
        holder.wait(10)


def test_a_directory_another_training_holds_is_refused_naming_the_holder(tmp_path):
    """Two runs with one --save both exited 0 and mixed their checkpoints; two runs with one
    --log-dir appended into one metrics.jsonl and one TensorBoard run."""
    with held_by_another_process(tmp_path / "ck") as pid:
        with pytest.raises(ConfigError, match=rf"--save '.*ck' is in use by another training \(pid {pid}\)"):
            with run_outputs(tmp_path / "ck", None):
                pass
    with run_outputs(tmp_path / "ck", None):  # released when the holder ends
        pass
    with held_by_another_process(tmp_path / "logs") as pid:
        with pytest.raises(ConfigError, match=rf"--log-dir '.*logs' is in use by another training \(pid {pid}\)"):
            with run_outputs(tmp_path / "ck", tmp_path / "logs"):
                pass
    with run_outputs(tmp_path / "both", tmp_path / "both"):  # one directory for both is held once
        with run_outputs(tmp_path / "both", None):  # and a caller's hold covers the launcher it calls
            pass


def _a_finished_run(save, logs, what="model A, seed 0, 1f1b"):
    with run_outputs(save, logs, what=what):
        (save / "step-4").mkdir()
        (logs / "metrics.jsonl").write_text('{"step": 4}\n')


def test_a_run_into_another_runs_files_is_refused_unless_it_continues_or_starts_over(tmp_path):
    save, logs = tmp_path / "ck", tmp_path / "logs"
    _a_finished_run(save, logs)
    before = sorted(path.name for path in save.iterdir()), (logs / "metrics.jsonl").read_text()
    for save_dir, log_dir, flag in ((save, None, "--save"), (tmp_path / "new", logs, "--log-dir")):
        with pytest.raises(ConfigError) as refusal:
            with run_outputs(save_dir, log_dir, what="model B, seed 1, zb-h1"):
                pass
        line = refusal.value.summary
        assert f"{flag} {str(save_dir if flag == '--save' else log_dir)!r} holds another run's files" in line
        assert "(model A, seed 0, 1f1b, started" in line and "--force" in line and "--resume" in line
    assert (sorted(path.name for path in save.iterdir()), (logs / "metrics.jsonl").read_text()) == before

    # continuing it: a resume from one of its checkpoints writes on into both of its directories
    with run_outputs(save, logs, resume_from=save / "step-4"):
        (save / "step-6").mkdir()
    assert RunIdentity.read(save) == RunIdentity.read(logs)

    # starting over: its files move to a sibling, whole; the new run's directories hold none of them
    with run_outputs(save, logs, force=True, what="model B, seed 1, zb-h1"):
        for directory in (save, logs):
            assert sorted(path.name for path in directory.iterdir()) == [".lock", OWNER_FILE]
    assert sorted(path.name for path in (tmp_path / "ck.replaced-1").iterdir()) == [OWNER_FILE, "step-4", "step-6"]
    assert (tmp_path / "logs.replaced-1" / "metrics.jsonl").read_text() == '{"step": 4}\n'
    assert RunIdentity.read(tmp_path / "ck.replaced-1").what == "model A, seed 0, 1f1b"
    assert RunIdentity.read(save).what == "model B, seed 1, zb-h1"


def test_checkpoints_from_before_runs_were_named_are_another_runs_too(tmp_path):
    """A directory written before `.run` files existed holds checkpoints of an unknown run: a
    new run is refused there, and a resume of them continues it."""
    (tmp_path / "ck" / "step-2").mkdir(parents=True)
    with pytest.raises(ConfigError, match="holds another run's files: step-2;"):
        with run_outputs(tmp_path / "ck", None):
            pass
    with run_outputs(tmp_path / "ck", None, resume_from=tmp_path / "ck"):
        pass
    assert RunIdentity.read(tmp_path / "ck") is not None


def test_a_refused_run_leaves_no_directory_it_made(tmp_path):
    """A fresh --save was made, then the --log-dir refused (it holds another run's metrics): the
    refused run left an empty checkpoint directory, claimed by a run that never ran."""
    _a_finished_run(tmp_path / "ck", tmp_path / "logs")
    with pytest.raises(ConfigError, match="--log-dir .* holds another run's files"):
        with run_outputs(tmp_path / "fresh" / "ck", tmp_path / "logs"):
            pass
    assert not (tmp_path / "fresh").exists()
    with held_by_another_process(tmp_path / "busy"):
        with pytest.raises(ConfigError, match="is in use by another training"):
            with run_outputs(tmp_path / "fresh" / "ck", tmp_path / "busy"):
                pass
    assert not (tmp_path / "fresh").exists()
