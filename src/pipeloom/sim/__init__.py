"""The simulator: time, memory and deadlock of a schedule under costs."""

from pipeloom.sim.simulate import OpTiming, Timeline, simulate

__all__ = ["OpTiming", "Timeline", "simulate"]
