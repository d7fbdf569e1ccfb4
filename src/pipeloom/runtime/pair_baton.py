"""An overlapped F&B pair as two threads that take turns (DeepSeek-V3's overlap, DualPipe §3).

DeepSeek cuts a forward and a backward into phases — attention, dispatch, experts, combine — and
runs one op's compute while the other's all-to-all is in flight. pipeloom runs the two ops as
they are (the library's layers, autograd's backward) on two threads that hand a baton back and
forth: only the holder runs, and an expert all-to-all, once issued asynchronously, passes the
baton before it waits (`pass_baton`). So the phases interleave exactly where the communication
is, the two ops never compute at once (the measured gain is hidden communication, not two
cores), and every rank of an expert-parallel group issues its collectives in the same order.

Why threads and not coroutines: the switch points sit deep inside the library's forward and
inside autograd's backward (a custom Function's backward), where no generator can yield. The
baton belongs to the pair, not to a thread: autograd may run a backward on a thread of its own
(on CUDA, its device thread), and an exchange issued there passes the baton all the same — since
only the holder runs, whoever calls `pass_baton` acts for the holder. One pair runs at a time
in a process (a device's ops run in order). Each turn is marked on a clock (`clocks`) at its
start and end, so an exchange knows how long the partner ran while it was in flight — on a GPU
from events on the partner's stream.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeloom.runtime.clocks import Clock, HostClock

__all__ = ["PairBaton", "Turn", "pass_baton", "run_pair"]

_active: PairBaton | None = None
"""The pair running in this process, if any."""


@dataclass(frozen=True)
class Turn:
    """A stretch one op of a pair ran, as marks on the pair's clock."""

    began: Any
    ended: Any


class PairBaton:
    def __init__(self, clock: Clock | None = None) -> None:
        self.clock = clock or HostClock()
        self._turn = threading.Condition()
        self._holder = 0
        self._running = [True, True]
        self._began: list[Any] = [None, None]
        self._ended: list[Any] = [None, None]

    def run(
        self,
        first: Callable[[], None],
        second: Callable[[], None],
        contexts: tuple[Callable[[], contextlib.AbstractContextManager], ...] = (),
    ) -> None:
        """Run `first` (on this thread) and `second` (on a helper) by turns, `first` from the start,
        each inside its context (`contexts`: e.g. the CUDA stream its kernels go to); re-raise the
        first error either raised."""
        global _active
        if _active is not None:
            raise RuntimeError("an overlapped pair started while another runs in this process")
        _active = self
        errors: list[BaseException | None] = [None, None]
        enter = list(contexts) or [contextlib.nullcontext, contextlib.nullcontext]
        helper = threading.Thread(target=self._side, args=(1, second, enter[1], errors), name="pipeloom-pair")
        helper.daemon = True
        helper.start()
        try:
            self._side(0, first, enter[0], errors)
            helper.join()
        finally:
            _active = None
        for error in errors:
            if error is not None:
                raise error

    def _side(self, index: int, work: Callable[[], None], context, errors: list) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._holder == index)
        try:
            with context():
                self._began[index] = self.clock.mark()
                try:
                    work()
                finally:
                    self._ended[index] = self.clock.mark()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors[index] = error
        finally:
            with self._turn:
                self._running[index] = False
                self._holder = 1 - index
                self._turn.notify_all()

    def pass_on(self) -> Turn | None:
        """Hand the baton to the partner (the holder's call, from whichever thread runs its work)
        and wait for it back; the partner's turn meanwhile (None: the partner is done)."""
        with self._turn:
            index = self._holder
            if not self._running[1 - index]:
                return None  # the partner is done: nothing to hide behind
            self._ended[index] = self.clock.mark()
            self._holder = 1 - index
            self._turn.notify_all()
            self._turn.wait_for(lambda: self._holder == index)
            self._began[index] = self.clock.mark()
            return Turn(self._began[1 - index], self._ended[1 - index])


def pass_baton() -> Turn | None:
    """Let the paired op run while the caller's collective is in flight; the partner's turn, or
    None outside a pair (or once the partner is done), when the caller simply waits."""
    baton = _active
    if baton is None:
        return None
    return baton.pass_on()


def run_pair(executor, step, first, second) -> None:
    """An overlapped F&B pair as `executor` (a `DeviceExecutor`) runs it, each op with its own
    times. With expert all-to-alls (`interleave_pairs`) the two run by turns, each switching to
    the other while its exchange is in flight; otherwise in list order (messages leave as the
    plan derived). On CUDA the forward runs on a side stream, its kernels and collectives under
    the backward's."""
    import torch

    from pipeloom.runtime.clocks import clock_for

    side, device = executor._side, executor.torch_device

    def on_stream(op) -> Callable[[], contextlib.AbstractContextManager]:
        if side is not None and op.kind.value == "F":
            return lambda: torch.cuda.stream(side)
        return contextlib.nullcontext

    ends: list = [None, None]

    def run(op, index: int = 0) -> None:
        executor._handler(op.kind)(step, op)
        ends[index] = step.now()

    if side is not None:
        side.wait_stream(torch.cuda.current_stream(device))
    if executor.interleave_pairs:
        began = step.now()
        baton = PairBaton(clock_for(device))  # the turns, for the exchanges
        baton.run(lambda: run(first, 0), lambda: run(second, 1), (on_stream(first), on_stream(second)))
        step.add_op(first.text, began, ends[0], math.nan)  # two threads share the pair's CPU time
        step.add_op(second.text, began, ends[1], math.nan)
    else:
        for op in (first, second):
            step.start = step.now()
            with on_stream(op)():
                run(op)
            step.end_op(op.text)
    if side is not None:
        torch.cuda.current_stream(device).wait_stream(side)
