"""Start the ranks of a training run on this machine: forked processes on CPU, spawned ones on GPUs
(one per GPU, as torchrun would), meeting at a TCP store rank 0 serves (`meeting`).

Used by `pipeloom train --nproc N` and the tests. Each rank writes its `RankResult` to a file;
the parent collects them, holding the run's output directories meanwhile (`run_outputs`). A rank
that fails reports one line; the parent then stops the others, so a dead or stalled peer never
leaves processes behind. A run past its deadline names where each live rank waits (`stuck_ranks`).
"""

from __future__ import annotations

import gc
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeloom.errors import ConfigError, PipeloomError, RuntimeFault, Stopped
from pipeloom.runtime import stuck_ranks
from pipeloom.runtime.boundary import StageProbe
from pipeloom.runtime.probe import check_probe_fits, probe_spec
from pipeloom.runtime.run_outputs import remove_partials, spec_outputs
from pipeloom.runtime.training import RankResult, TrainSpec, check_spec, train_rank

__all__ = ["meeting", "run_deadline_s", "run_local"]


def _worker(
    spec: TrainSpec | Callable[[], TrainSpec],
    rank: int,
    world_size: int,
    directory: str,
    probe: StageProbe | None = None,
) -> None:
    """One rank: `spec` itself (forked), or (spawned) the picklable recipe that rebuilds it here."""
    # What a forked rank inherited (torch's objects, the caller's) stays out of its garbage
    # collections: a full one would write to each object's header, copying every page of the
    # parent's heap — longer than a small rank's whole training.
    gc.freeze()
    # Ctrl-C reaches the whole foreground group: the launcher stops the ranks, which would
    # otherwise each print a traceback. SIGTERM (the launcher's) ends a rank at once.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for number in (signal.SIGTERM, signal.SIGHUP):  # not the launcher's handlers, inherited by the fork
        signal.signal(number, signal.SIG_DFL)
    _end_with_the_launcher(os.getppid(), directory)
    stuck_ranks.arm(stuck_ranks.stack_file(directory, rank))
    os.environ["LOCAL_RANK"] = str(rank)  # one machine: rank r drives GPU r, as torchrun's would
    spawned = not isinstance(spec, TrainSpec)
    try:
        if not isinstance(spec, TrainSpec):
            spec = spec()
        with meeting(rank, world_size, directory, spec.timeout_s) as store:
            result = train_rank(spec, rank, world_size, store, probe=probe, tear_down=spec.resolved_backend != "gloo")
            torch.save(result, f"{directory}/rank{rank}.pt")
        if spawned:
            # A spawned rank would otherwise finalise the interpreter, destroying gloo's process
            # groups with their threads still joinable: C++ terminates it (SIGABRT, "terminate
            # called without an active exception"), once in a loaded suite. Its results are on
            # file; a forked rank ends this way already (multiprocessing's fork exits with _exit).
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    except ConfigError as error:  # bad input: the root cause, whatever its peers then report
        Path(f"{directory}/rank{rank}.error").write_text(error.summary)
        sys.exit(_BAD_INPUT)
    except PipeloomError as error:
        Path(f"{directory}/rank{rank}.error").write_text(error.summary)
        sys.exit(_FAULT)
    except BaseException:  # noqa: BLE001 - a crash must still end this rank with a reason on file
        Path(f"{directory}/rank{rank}.error").write_text(traceback.format_exc().strip().splitlines()[-1])
        sys.exit(_CRASH)


@contextmanager
def meeting(rank: int, world_size: int, directory: str, timeout_s: float) -> Iterator[dist.TCPStore]:
    """The store a run's ranks meet at, for the block: rank 0 serves it on a port of 127.0.0.1
    the kernel picks (no two runs race for one) and leaves the port in the run's directory,
    where the others wait for it. A FileStore's ranks poll its file for each key of a peer's, and
    each process group a rank creates (a run's mesh makes a dozen) would wait for a poll; a
    store the launcher served would be inherited open by every rank it forks.

    A block that ends normally says so in the store, and rank 0 then waits until every rank has,
    so that no peer still finishing (its last collectives, its results) finds the store gone
    with it. It waits without a timeout of its own (each one ending would print c10d's
    warning): a peer that fails or overruns the run's deadline is stopped by the launcher, which
    stops rank 0 too, and a launcher gone ends its ranks (`_end_with_the_launcher`)."""
    port_file = Path(directory, "store-port")
    if rank == 0:
        store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        written = port_file.with_suffix(".partial")
        written.write_text(str(store.port))
        written.rename(port_file)  # whole or absent to a peer that reads it
    else:
        deadline = time.monotonic() + timeout_s
        while not port_file.exists():
            if time.monotonic() > deadline:
                raise RuntimeFault(f"rank {rank}: rank 0 opened no store within {timeout_s:g} s")
            time.sleep(0.002)
        port = int(port_file.read_text())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=timeout_s))
    yield store
    if store.add("ranks left", 1) == world_size:
        store.set("every rank left", "1")
    if rank == 0:
        store.wait(["every rank left"], timedelta(days=1))


def _end_with_the_launcher(launcher: int, directory: str) -> None:
    """A launcher killed outright (SIGKILL: the OOM killer, a scheduler's preemption) runs no
    handler, and its ranks would train on as orphans, holding its temporary directory. A thread
    of each rank sees the re-parenting within `_WATCH_S`, even while the rank waits inside a
    collective, removes the directory and ends the rank."""

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(_WATCH_S)
        shutil.rmtree(directory, ignore_errors=True)
        os._exit(_FAULT)

    threading.Thread(target=watch, name="pipeloom-launcher-watch", daemon=True).start()


_WATCH_S = 0.2
_STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""What stops a run: Ctrl-C, a kill, and the terminal closing."""
_BAD_INPUT, _FAULT, _CRASH = 2, 3, 4
_KILLED = -1  # any negative exit code: ended by a signal it could not handle (the OOM killer's SIGKILL)
_ROOT_FIRST = (_BAD_INPUT, _KILLED, _CRASH, _FAULT)
"""Which failed rank the launcher reports: bad input, then one killed by a signal (it ran no
handler and left no reason: its peers' "connection closed" echoes it), then a crash, then a fault
(a peer that closed its connection is usually the echo of another rank's failure, not its cause)."""


def _root_cause(processes, first: int) -> int:
    """The rank whose failure explains the others: the peers of a failed rank fail a moment later
    with "connection closed", so wait up to 2 s for them and pick by `_ROOT_FIRST`."""
    deadline = time.monotonic() + 2.0
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    codes = [process.exitcode for process in processes]
    kinds = [_KILLED if code is not None and code < 0 else code for code in codes]
    ranked = sorted(
        (i for i, code in enumerate(codes) if code not in (None, 0)),
        key=lambda i: (_ROOT_FIRST.index(kinds[i]) if kinds[i] in _ROOT_FIRST else len(_ROOT_FIRST), i),
    )
    return ranked[0] if ranked else first


def _failure_of(process, directory: str, rank: int) -> str:
    """What a failed rank left on file, or how it ended: a signal it could not handle (and where
    it died, where it could say: `stuck_ranks.where_died`), or its status."""
    reason_file = Path(f"{directory}/rank{rank}.error")
    if reason_file.exists():
        return reason_file.read_text()
    code = process.exitcode
    if code is not None and code < 0:
        return f"killed by {signal.Signals(-code).name}{stuck_ranks.where_died(directory, rank)}"
    return f"exit status {code}"


def _import_before_forking() -> None:
    """Import in the parent what every rank would otherwise import on its own, lazily: torch's
    compiler front end (the optimizer's step and the FLOP counter reach it) alone takes longer
    than a small rank's whole training, and a forked child inherits what its parent imported."""
    import torch._dynamo  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401


def run_deadline_s(spec: TrainSpec) -> float:
    """How long a run may take before the launcher calls it stuck: the per-step deadline
    (`timeout_s`, what a rank waits for a peer) for each step and for each held-out batch its
    evaluations run — a fixed 300 s ended long runs, and many evaluation batches, as "did not finish"."""
    evaluations = spec.steps // spec.eval_every if spec.eval_every else 0
    return spec.timeout_s * max(1, spec.steps + evaluations * spec.eval_batches)


def run_local(
    spec: TrainSpec,
    timeout_s: float | None = None,
    probe: StageProbe | None = None,
    progress: bool = False,
    recipe: Callable[[], TrainSpec] | None = None,
) -> list[RankResult]:
    """Run all p × dp × tp ranks of `spec` as processes of this machine; return their results by
    rank.

    On CPU the ranks are forked (they inherit the spec and what the parent imported). With
    `--device cuda` — or whenever `recipe` is given — they are spawned, as torchrun starts them:
    CUDA cannot be used in a forked child, so this process never touches CUDA, and each rank
    rebuilds the spec from `recipe` (a picklable function; a spec's workload holds closures),
    drives GPU `rank` (LOCAL_RANK) and checks that it can.
    What crosses the stage boundaries is the same for every rank, so it is probed once here
    (or given: `probe_spec(spec)`, for a caller that runs one spec many times) and handed on.
    `progress`: print as `pipeloom train` does — each step's line, then the per-rank table.
    `timeout_s`: the whole run's deadline; by default `run_deadline_s(spec)`, as the CLI's."""
    if progress:
        spec = spec.changed(report=True)
    if spec.torch_device_type == "cuda" and recipe is None:
        raise ConfigError(
            "run_local: CUDA ranks are spawned and rebuild the spec from a recipe (a picklable function "
            "returning it); pass recipe=, or start the ranks with torchrun"
        )
    results = _run_local(spec, run_deadline_s(spec) if timeout_s is None else timeout_s, probe, recipe)
    if progress:
        from pipeloom.runtime.report import run_report

        print(run_report(results, spec), flush=True)
    return results


def _run_local(
    spec: TrainSpec, timeout_s: float, probe: StageProbe | None, recipe: Callable[[], TrainSpec] | None
) -> list[RankResult]:
    world_size = spec.parallelism.layout.world_size
    check_spec(spec, world_size, on_this_device=spec.torch_device_type == "cpu")  # a GPU's checks: its rank's
    probe = probe or probe_spec(spec)
    check_probe_fits(spec, probe)
    handed: TrainSpec | Callable[[], TrainSpec] = spec if recipe is None else recipe
    if recipe is None:
        _import_before_forking()
    context: Any = multiprocessing.get_context("fork" if recipe is None else "spawn")
    with spec_outputs(spec), tempfile.TemporaryDirectory(prefix="pipeloom-") as directory:
        processes = [
            context.Process(target=_worker, args=(handed, rank, world_size, directory, probe), daemon=True)
            for rank in range(world_size)
        ]
        failed = None
        with _signals_noted() as received:  # from the first fork: no window to orphan a rank in
            for process in processes:
                process.start()
            deadline = time.monotonic() + timeout_s
            while alive := [process for process in processes if process.is_alive()]:
                failed = next((i for i, process in enumerate(processes) if process.exitcode not in (None, 0)), None)
                if failed is not None or time.monotonic() > deadline or received:
                    break
                # woken by a rank's exit at once; a signal is noted within the timeout
                multiprocessing.connection.wait([process.sentinel for process in alive], timeout=0.05)
        if received:
            _stop(processes)
            remove_partials(spec.save_dir)
            name = signal.Signals(received[0]).name
            raise Stopped(f"stopped by {name}: every rank ended; only complete checkpoints remain", received[0])
        if failed is None:
            failed = next((i for i, process in enumerate(processes) if process.exitcode not in (None, 0)), None)
        if failed is not None or any(process.is_alive() for process in processes):
            if failed is None:
                hung = {i: process.pid for i, process in enumerate(processes) if process.is_alive() and process.pid}
                where = stuck_ranks.where_stuck(hung, directory, entry=train_rank.__name__)
                _stop(processes)
                raise RuntimeFault(f"training did not finish within {timeout_s:g} s: {where}")
            failed = _root_cause(processes, failed)
            _stop(processes)
            reason = _failure_of(processes[failed], directory, failed)
            raise RuntimeFault(f"rank {failed} failed: {reason}")
        for process in processes:
            process.join()
        # map_location: a stray device tensor in a result must not bring CUDA into this process
        return [
            torch.load(f"{directory}/rank{rank}.pt", weights_only=False, map_location="cpu")
            for rank in range(world_size)
        ]


def _stop(processes) -> None:
    """SIGTERM to every rank still alive, then SIGKILL to any that outlives 5 s."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive() and process.pid is not None:
            os.kill(process.pid, signal.SIGKILL)


@contextmanager
def _signals_noted() -> Iterator[list[int]]:
    """SIGINT, SIGTERM and SIGHUP noted (into the list yielded) instead of ending the launcher at
    once, which left its ranks training as orphans; restored after. Off the main thread, where
    Python allows no handler, the list stays empty."""
    received: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield received
        return
    previous = {number: signal.getsignal(number) for number in _STOPPING}
    for number in previous:
        signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
