"""What the runtime adds beyond the ops it times, fitted from the probes' measured phases.

- Per op: the executor's own work around each op (picking it, posting and matching messages,
  recording it). It is the ε that, added to every op of a probe's schedule, makes the simulated
  pipeline as long as the measured one; the median over probes is kept.
- Optimizer: the AdamW step, linear in the parameters a rank holds.
- Step overhead: the rest of a step (the batch, the loss all-reduce), and zeroing the gradient
  buffers a device's replicas sum in place, linear in their parameters (`profiler.step_overhead`).
Torch-free: it reads numbers and simulates schedules.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import simulate

__all__ = ["op_overhead_ms", "serial_op_overhead_ms", "linear_fit", "with_op_overhead"]

_STEPS = 40
"""Bisection steps: ε to well below a microsecond."""


def with_op_overhead(costs: Costs, overhead: float) -> Costs:
    """`costs` with `overhead` added to every op's time (F, B, W, and R, BW and F_BW where they
    are set apart from F and from B + W)."""
    if not overhead:
        return costs

    def more(values):
        return [value + overhead for value in values] if isinstance(values, (list, tuple)) else values + overhead

    changed = {
        key: more(getattr(costs, key)) for key in ("F", "B", "W", "R", "BW", "F_BW") if getattr(costs, key) is not None
    }
    return replace(costs, **changed)


def op_overhead_ms(schedule: Schedule, costs: Costs, measured_pipeline: float) -> float:
    """The ε per op at which `schedule`'s simulated makespan under `costs` reaches
    `measured_pipeline`. It may be negative (down to half the shortest op): the op medians are
    noisy too, and a median over probes of clipped values would lean high or low."""
    ops = max(len(device) for device in schedule.devices)
    shortest = min(t for key in ("F", "B", "W") for t in _flat(getattr(costs, key)) if t > 0)
    low, high = -shortest / 2, measured_pipeline / ops
    if simulate(schedule, with_op_overhead(costs, low)).makespan >= measured_pipeline:
        return low
    for _ in range(_STEPS):
        middle = (low + high) / 2
        if simulate(schedule, with_op_overhead(costs, middle)).makespan < measured_pipeline:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def serial_op_overhead_ms(schedule: Schedule, costs: Costs, measured_pipeline: float) -> float:
    """The ε per op when every op of `schedule` ran one after another in one process (a probe in
    process: on one GPU its stages share the device): the measured pipeline less the ops' own
    times, over their number."""
    return (measured_pipeline - sum(simulate(schedule, costs).busy_time)) / schedule.num_ops


def _flat(value) -> list[float]:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of least squares over (x, y), both kept ≥ 0."""
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return max(0.0, mean_y - slope * mean_x), slope
