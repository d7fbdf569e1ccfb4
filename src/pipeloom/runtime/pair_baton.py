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

import threading
from collections.abc import Callable

__all__ = ["PairBaton", "pass_baton"]

_held = threading.local()


class PairBaton:
    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._holder = 0
        self._running = [True, True]

    def run(self, first: Callable[[], None], second: Callable[[], None]) -> None:
        """Run `first` (on this thread) and `second` (on a helper) by turns, `first` from the start;
        re-raise the first error either raised."""
        errors: list[BaseException | None] = [None, None]
        helper = threading.Thread(target=self._side, args=(1, second, errors), name="pipeloom-pair", daemon=True)
        helper.start()
        self._side(0, first, errors)
        helper.join()
        for error in errors:
            if error is not None:
                raise error

    def _side(self, index: int, work: Callable[[], None], errors: list) -> None:
        with self._turn:
            self._turn.wait_for(lambda: self._holder == index)
        _held.baton, _held.index = self, index
        try:
            work()
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            errors[index] = error
        finally:
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
