"""Where a rank that outlived the launcher's deadline is stuck, or where one that crashed died,
read off its own stacks.

A run that hangs — a collective one rank never joins, a lock a fork inherited mid-use — would
otherwise end in "did not finish within 300 s" with nothing to go on, and a hang that shows
once in a hundred runs cannot be rerun under a debugger. So each forked rank arms faulthandler
(`arm`): on SIGUSR1 it writes every thread's Python stack to a file, from the signal handler,
so even a rank blocked inside a C call answers. Before stopping the ranks still alive, the
launcher signals them (`where_stuck`) and names, per rank, the innermost frame of the thread
that trains and the innermost pipeloom frame on the way to it: enough to tell a collective
from a receive from a rank that never began training. A rank killed by a fatal signal (a
segmentation fault inside a C library) writes its stacks as it dies, and the launcher names
the frame the crashing thread was in (`where_died`) beside the signal.
"""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import time
from pathlib import Path

__all__ = ["arm", "where_died", "where_stuck"]

_FRAME = re.compile(r'^\s+File "(?P<path>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')
_PACKAGE = str(Path(__file__).parent.parent)
_ANSWER_S = 2.0
"""How long the ranks have to write their stacks: a signal handler's write, on a busy machine."""


def stack_file(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"rank{rank}.stacks"


def arm(path: Path) -> None:
    """Have this process write its threads' stacks to `path` on SIGUSR1 (appending, so that the
    launcher can empty the file before it asks), and as a fatal signal kills it."""
    handle = path.open("a")  # noqa: SIM115 - open for the rank's life: the handler writes to it
    faulthandler.register(signal.SIGUSR1, file=handle, all_threads=True)
    faulthandler.enable(file=handle, all_threads=True)


def where_stuck(pids: dict[int, int], directory: str | os.PathLike, entry: str) -> str:
    """One clause per rank (rank → pid of a live, armed process): where its thread that runs the
    function `entry` waits."""
    files = {rank: stack_file(directory, rank) for rank in pids}
    for rank, pid in pids.items():
        files[rank].write_text("")
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + _ANSWER_S
    while time.monotonic() < deadline and not all("most recent call first" in f.read_text() for f in files.values()):
        time.sleep(0.02)
    time.sleep(0.05)  # the handlers may still be writing the outer frames
    return "; ".join(f"rank {rank} {_summary(files[rank].read_text(), entry)}" for rank in sorted(pids))


def where_died(directory: str | os.PathLike, rank: int) -> str:
    """Where a rank a fatal signal killed was, from the stacks it wrote as it died: " in" the
    crashing thread's innermost frame and " from" its innermost pipeloom frame; " outside Python"
    where the crash was in a thread Python does not run (a library's own); "" where it wrote
    nothing (SIGKILL, which no handler sees)."""
    path = stack_file(directory, rank)
    text = path.read_text() if path.exists() else ""
    if "Fatal Python error" not in text:
        return ""
    current = next((frames for header, frames in _threads(text) if header.startswith("Current thread")), None)
    if not current:
        return " outside Python"
    own = next((f for f in current if f["path"].startswith(_PACKAGE)), None)
    return f" in {_where(current[0])}" + (f" from {_where(own)}" if own is not None and own is not current[0] else "")


def _threads(text: str) -> list[tuple[str, list[re.Match]]]:
    """Each thread faulthandler wrote: its header line and its frames, innermost first."""
    threads: list[tuple[str, list[re.Match]]] = []
    for line in text.splitlines():
        if "most recent call first" in line:
            threads.append((line, []))
        elif threads and (frame := _FRAME.match(line)):
            threads[-1][1].append(frame)
    return threads


def _summary(text: str, entry: str) -> str:
    threads = [frames for _, frames in _threads(text)]
    if not any(threads):
        return f"gave no stack within {_ANSWER_S:g} s"
    training = next((frames for frames in threads if any(f["function"] == entry for f in frames)), None)
    if training is None:
        return f"is not in {entry} (stuck before or after it)"
    innermost = training[0]
    clause = f"waits in {_where(innermost)}"
    own = next((f for f in training if f["path"].startswith(_PACKAGE)), None)
    if own is not None and own is not innermost:
        clause += f" from {_where(own)}"
    return clause


def _where(frame: re.Match) -> str:
    return f"{frame['function']} ({Path(frame['path']).name}:{frame['line']})"
