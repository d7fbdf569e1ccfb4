"""The simulator: time, memory and deadlock of a schedule under costs."""

from pipeloom.sim.grad_sync import exposed_sync, sync_lanes
from pipeloom.sim.simulate import OpTiming, Timeline, simulate

__all__ = ["OpTiming", "Timeline", "exposed_sync", "simulate", "sync_lanes"]
