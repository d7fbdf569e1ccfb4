"""Two clocks for timing work the runtime issues: the host's, and the device's (CUDA events).

On a CPU the work runs when it is issued, so the host's clock times it. On a GPU a call returns
once its kernels are queued — a host clock around an all-to-all reads the time to issue it, not
the time the GPU spent on it — so the device's clock records an event on the current stream
(the stream the work runs on) and reads the interval only once the device has passed both
events: at the step's end, after its one read of the device.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

__all__ = ["Clock", "HostClock", "DeviceClock", "clock_for"]


class Clock(Protocol):
    immediate: bool
    """Whether a mark's interval can be read at once (the host's), or only once the device has
    passed it (the device's: after the step's read of the device)."""

    def mark(self) -> Any:
        """A point in time, now — on the current stream, for the device's clock."""
        ...

    def seconds(self, began: Any, ended: Any) -> float:
        """Seconds from `began` to `ended` (negative when `ended` came first)."""
        ...


class HostClock:
    immediate = True

    def mark(self) -> float:
        return time.perf_counter()

    def seconds(self, began: float, ended: float) -> float:
        return ended - began


class DeviceClock:
    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device
        """Named, not taken from the thread: a helper thread's current device is the first GPU."""

    def mark(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def seconds(self, began: torch.cuda.Event, ended: torch.cuda.Event) -> float:
        return began.elapsed_time(ended) / 1e3


def clock_for(device: torch.device) -> Clock:
    return DeviceClock(device) if device.type == "cuda" else HostClock()
