"""Candidates simulated on several cores, with the same answer as on one.

The search prunes each candidate against the `keep`-th best plan found before it, which makes it
sequential by nature. So it runs in rounds of a fixed number of candidates (`ROUND`, the same for
any number of jobs): every candidate of a round is simulated with the threshold known when the
round began — on as many processes as there are jobs — and the round's results are then taken
in order. What each candidate is simulated with never depends on the number of jobs, so the
ranking, the rejected list and the counts do not either.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

__all__ = ["ROUND", "default_jobs", "fewer_collections", "RoundPool"]

ROUND = 16
"""Candidates per round: enough that one slow candidate does not leave the other cores idle
while the round ends (16 measured fastest on 2 cores for bench/tune_speed.py), few enough that
a good plan found early soon prunes the next rounds."""


def default_jobs() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


YOUNG_COLLECTION = 50_000
"""Allocations between the cyclic collector's young passes while the tuner searches (Python's
default is 700). Building and simulating schedules allocates millions of small objects that
die young or live on in the ranking; at the default, the collector's passes over them took a
fifth of the default `tune` command (10.6 s against 8.6 s without any, on 2 cores)."""


@contextmanager
def fewer_collections() -> Iterator[None]:
    """The collector's young threshold raised to `YOUNG_COLLECTION` for the block, then restored:
    garbage cycles (a schedule and its cached graph) are still collected, just in bigger batches."""
    before = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION, *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


_task: tuple[Callable, Callable] | None = None  # the worker's (simulate, pack)


def _start_worker(simulate: Callable, pack: Callable) -> None:
    global _task
    _task = (simulate, pack)
    gc.freeze()  # a forked worker's collections leave its parent's heap alone (copying each page they touch)
    gc.set_threshold(YOUNG_COLLECTION, *gc.get_threshold()[1:])  # a worker of ours only searches


def _run(evaluation, threshold: float):
    assert _task is not None, "set by _start_worker in every worker"
    simulate, pack = _task
    return pack(simulate(evaluation, threshold), threshold)


def _as_is(result, threshold: float):
    return result


class RoundPool:
    """`simulate(evaluation, threshold)` over one round's candidates, on `jobs` processes.

    `pack(result, threshold)` trims what a worker sends back (a process pickles it)."""

    def __init__(self, simulate: Callable, jobs: int, pack: Callable = _as_is):
        self.simulate = simulate
        self.pool = None
        if jobs > 1:  # imported here: one process needs no multiprocessing machinery
            from concurrent.futures import ProcessPoolExecutor

            self.pool = ProcessPoolExecutor(jobs, initializer=_start_worker, initargs=(simulate, pack))

    def __enter__(self) -> RoundPool:
        return self

    def __exit__(self, *exc) -> None:
        if self.pool:
            self.pool.shutdown(wait=True, cancel_futures=True)

    def run(self, evaluations: Sequence, threshold: float, sizes: Sequence[float] | None = None) -> list:
        """The results, in the order given. With `sizes` (a guess at each one's work), the
        largest are sent first, so that no core is left with a big one as the round ends."""
        if self.pool is None or len(evaluations) < 2:
            return [self.simulate(evaluation, threshold) for evaluation in evaluations]
        order = sorted(range(len(evaluations)), key=lambda i: -sizes[i]) if sizes else range(len(evaluations))
        futures = {i: self.pool.submit(_run, evaluations[i], threshold) for i in order}
        return [futures[i].result() for i in range(len(evaluations))]
