"""Which device of a list-scheduled pipeline acts next: the one with the earliest clock."""

from __future__ import annotations

import math
from heapq import heappop, heappush

__all__ = ["Agenda"]


class Agenda:
    """Devices by clock (ties to the lower device), and the earliest clock strictly after a
    time: how long a device without a ready op may wait. Many devices share a clock (they wait
    for the same one), so distinct clocks are kept apart, counted, in a heap of their own."""

    def __init__(self, p: int):
        self.events = [(0.0, d) for d in range(p)]
        self.counts = {0.0: p}
        self.clocks = [0.0]  # distinct clocks; one no device holds any more is dropped lazily

    def __bool__(self) -> bool:
        return bool(self.events)

    def push(self, clock: float, device: int) -> None:
        heappush(self.events, (clock, device))
        held = self.counts.get(clock, 0)
        self.counts[clock] = held + 1
        if not held:
            heappush(self.clocks, clock)

    def pop(self) -> tuple[float, int]:
        clock, device = heappop(self.events)
        held = self.counts[clock] - 1
        if held:
            self.counts[clock] = held
        else:
            del self.counts[clock]
        return clock, device

    def earliest_after(self, time: float) -> float:
        clocks, counts = self.clocks, self.counts
        passed: list[float] = []
        while clocks and (clocks[0] <= time or clocks[0] not in counts):
            clock = heappop(clocks)
            if clock in counts and (not passed or passed[-1] != clock):
                passed.append(clock)
        found = clocks[0] if clocks else math.inf
        for clock in passed:
            heappush(clocks, clock)
        return found
