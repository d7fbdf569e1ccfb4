"""A run past its deadline names where each live rank waits, from the ranks' own stacks."""

from __future__ import annotations

import inspect
import multiprocessing
import threading
import time

from pipeloom.runtime import stuck_ranks


def _blocks_in_training(ready) -> None:
    ready.send(True)
    while True:
        time.sleep(60)


def _elsewhere() -> None:
    while True:
        time.sleep(60)


def _armed_rank(path, ready) -> None:
    stuck_ranks.arm(path)
    threading.Thread(target=_elsewhere, daemon=True).start()  # a thread that does not train
    _blocks_in_training(ready)


def test_a_hung_rank_is_named_with_the_frame_its_training_thread_waits_in(tmp_path):
    receiving, sending = multiprocessing.Pipe(duplex=False)
    rank = multiprocessing.get_context("fork").Process(
        target=_armed_rank, args=(stuck_ranks.stack_file(tmp_path, 3), sending), daemon=True
    )
    rank.start()
    try:
        assert receiving.poll(30) and receiving.recv()
        line = inspect.getsourcelines(_blocks_in_training)[1] + 3
        expected = f"rank 3 waits in _blocks_in_training (test_stuck_ranks.py:{line})"
        deadline = time.monotonic() + 30  # between its message and its sleep, it waits elsewhere
        while (where := stuck_ranks.where_stuck({3: rank.pid}, tmp_path, "_blocks_in_training")) != expected:
            assert time.monotonic() < deadline, where
        # asked of a function no thread runs, it says so rather than guess
        assert (
            stuck_ranks.where_stuck({3: rank.pid}, tmp_path, "train_rank")
            == "rank 3 is not in train_rank (stuck before or after it)"
        )
    finally:
        rank.kill()
        rank.join()


def test_a_crashed_rank_is_named_with_the_frame_its_crashing_thread_died_in(tmp_path):
    """faulthandler's dump as a fatal signal kills a rank: the current thread's innermost frame
    and its innermost pipeloom frame; none where the crash was in a thread Python does not run;
    nothing where the rank wrote nothing (SIGKILL)."""
    package = stuck_ranks._PACKAGE
    fatal = (
        "Fatal Python error: Segmentation fault\n\n"
        "Thread 0x00007f01 (most recent call first):\n"
        '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n\n'
        "Current thread 0x00007f02 (most recent call first):\n"
        '  File "/lib/torch/nn/functional.py", line 2380 in linear\n'
        f'  File "{package}/runtime/executor.py", line 212 in run_op\n'
        f'  File "{package}/runtime/training.py", line 90 in train_rank\n'
    )
    path = stuck_ranks.stack_file(tmp_path, 1)
    path.write_text(fatal)
    assert stuck_ranks.where_died(tmp_path, 1) == " in linear (functional.py:2380) from run_op (executor.py:212)"
    path.write_text(fatal.replace("Current thread", "Thread"))
    assert stuck_ranks.where_died(tmp_path, 1) == " outside Python"
    path.write_text("")
    assert stuck_ranks.where_died(tmp_path, 1) == stuck_ranks.where_died(tmp_path, 2) == ""
