"""An overlapped F&B pair as two threads that take turns (DeepSeek-V3's overlap, DualPipe §3).

DeepSeek cuts a forward and a backward into phases — attention, dispatch, experts, combine — and
runs one op's compute while the other's all-to-all is in flight. pipeloom runs the two ops as
they are (the library's layers, autograd's backward) on two threads that hand a baton back and
forth: only the holder runs, and an expert all-to-all, once issued asynchronously, passes the
baton before it waits (`pass_baton`). So the phases interleave exactly where the communication
is, the two ops never compute at once (the measured gain is hidden communication, not two
cores), and every rank of an expert-parallel group issues its collectives in the same order.

Why threads and not coroutines: the switch points sit deep inside the library's forward and
inside autograd's backward (a custom Function's backward), where no generator can yield. Only
one thread runs at a time, so the executor's state needs no locks. CPU autograd runs a
backward on the thread that calls it, which is what lets the backward's own all-to-alls pass
the baton too.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

__all__ = ["PairBaton", "pass_baton", "run_pair"]

_held = threading.local()


class PairBaton:
    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._holder = 0
        self._running = [True, True]

    def run(
        self, first: Callable[[], None], second: Callable[[], None], clock: Callable[[], float] = time.perf_counter
    ) -> tuple[float, float]:
        """Run `first` (on this thread) and `second` (on a helper) by turns, `first` from the start;
        re-raise the first error either raised. Returns when each finished, on `clock`."""
        errors: list[BaseException | None] = [None, None]
        ends = [0.0, 0.0]
        helper = threading.Thread(target=self._side, args=(1, second, errors, ends, clock), name="pipeloom-pair")
        helper.daemon = True
        helper.start()
        self._side(0, first, errors, ends, clock)
        helper.join()
        for error in errors:
            if error is not None:
                raise error
        return ends[0], ends[1]

    def _side(self, index: int, work: Callable[[], None], errors: list, ends: list, clock) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._holder == index)
        _held.baton, _held.index = self, index
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors[index] = error
        finally:
            ends[index] = clock()
            _held.baton = None
            with self._turn:
                self._running[index] = False
                self._holder = 1 - index
                self._turn.notify_all()

    def pass_on(self, index: int) -> None:
        with self._turn:
            if not self._running[1 - index]:
                return  # the partner is done: nothing to hide behind
            self._holder = 1 - index
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._holder == index)


def pass_baton() -> bool:
    """Let the paired op run while this thread's collective is in flight; False outside a pair
    (or once the partner is done), when the caller simply waits."""
    baton = getattr(_held, "baton", None)
    if baton is None or not baton._running[1 - _held.index]:
        return False
    baton.pass_on(_held.index)
    return True


def run_pair(executor, step, first, second) -> None:
    """An overlapped F&B pair as `executor` (a `DeviceExecutor`) runs it, each op with its own
    times. With expert all-to-alls (`interleave_pairs`) the two run by turns, each switching to
    the other while its exchange is in flight; otherwise in list order (messages leave as the
    plan derived). On CUDA the forward runs on a side stream, its kernels and collectives under
    the backward's."""
    import torch

    side, device = executor._side, executor.torch_device

    def run(op) -> None:
        if side is not None and op.kind.value == "F":
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                executor._forward_op(step, op)
        else:
            executor._handler(op.kind)(step, op)

    if executor.interleave_pairs:
        began = step.now()
        ends = PairBaton().run(lambda: run(first), lambda: run(second), step.now)
        step.record.ops += [(first.text, began, ends[0]), (second.text, began, ends[1])]
        step.record.op_cpu += [math.nan, math.nan]
    else:
        for op in (first, second):
            step.start = step.now()
            run(op)
            step.end_op(op.text)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
