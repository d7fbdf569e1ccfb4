"""Units of the numbers we print and plot, read from the costs that produced them.

Costs measured or modelled (a profile, the tuner's cost models) say so: milliseconds and bytes.
Costs typed bare are unit-less; their memory counts micro-batches' activations of one device's
share when M_B = 1, which we call "M_B". A figure never leaves without its unit.
"""

from __future__ import annotations

from collections.abc import Iterable

from pipeloom.costs import Costs

__all__ = ["MemoryScale", "bytes_scale", "memory_scale", "memory_unit", "time_unit", "format_time"]

_MIB, _GIB = 2**20, 2**30


def time_unit(costs: Costs) -> str:
    """ "ms" (or the costs' own unit), else "units" for bare numbers."""
    return costs.time_unit or "units"


def memory_unit(costs: Costs) -> str:
    """What the costs' memory figures are in, as JSON and the costs line name it: "bytes", "M_B"
    or "units" (tables scale bytes to MiB or GiB with `memory_scale`)."""
    return "bytes" if costs.memory_unit == "bytes" else memory_scale(costs).unit


def format_time(value: float, costs: Costs) -> str:
    return f"{value:.6g} {time_unit(costs)}"


class MemoryScale:
    """One divisor and label for a set of memory figures, so a table's column reads in one unit."""

    __slots__ = ("divisor", "unit")

    def __init__(self, divisor: float, unit: str) -> None:
        self.divisor, self.unit = divisor, unit

    def value(self, amount: float) -> float:
        return amount / self.divisor

    def number(self, amount: float) -> str:
        """The amount in this unit, without the unit (for a column whose header names it)."""
        scaled = amount / self.divisor
        return f"{scaled:.2f}" if self.divisor > 1 else f"{scaled:.6g}"

    def text(self, amount: float) -> str:
        return f"{self.number(amount)} {self.unit}"


def memory_scale(costs: Costs, amounts: Iterable[float] = ()) -> MemoryScale:
    """GiB or MiB for costs in bytes (GiB once the largest amount reaches one), else M_B when a
    micro-batch's activations are the unit (M_B = 1), else "units"."""
    if costs.memory_unit == "bytes":
        return bytes_scale(amounts)
    return MemoryScale(1.0, "M_B" if costs.M_B == 1.0 else "units")


def bytes_scale(amounts: Iterable[float]) -> MemoryScale:
    """GiB once the largest of the byte counts `amounts` reaches one, else MiB."""
    largest = max(amounts, default=0.0)
    return MemoryScale(_GIB, "GiB") if largest >= _GIB else MemoryScale(_MIB, "MiB")
