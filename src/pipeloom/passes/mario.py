"""Mario's driver: checkpoint where memory is short, then apply the passes while they pay.

The passes (`checkpoint.py`) run in rounds — overlap the recomputes, move them into earlier gaps,
remove redundant checkpoints, prepose checkpointed forwards — and a rewrite is kept only when
the simulator says the makespan did not grow and every device stays within the memory limit.
Rounds stop when one changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pipeloom.budget import per_device
from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.checkpoint import (
    apply_checkpoint,
    overlap_recompute,
    prepose_forward,
    refuse_pairs,
    relax_checkpoint,
    remove_redundancy,
)

__all__ = ["mario"]

_EPS = 1e-9
_PASSES: tuple[tuple[str, Callable[[Schedule, Costs, list[float]], Schedule]], ...] = (
    ("overlap_recompute", lambda s, c, limits: overlap_recompute(s)),
    ("overlap_recompute(into_gaps)", lambda s, c, limits: overlap_recompute(s, c, into_gaps=True)),
    ("remove_redundancy", lambda s, c, limits: remove_redundancy(s)),
    ("relax_checkpoint", relax_checkpoint),
    ("prepose_forward", lambda s, c, limits: prepose_forward(s, c)),
)


def mario(
    schedule: Schedule,
    costs: Costs,
    mem_limit: float | Sequence[float] | None = None,
    *,
    devices: Collection[int] | None = None,
    stages: Collection[int] | None = None,
    max_rounds: int = 10,
    trace: list[tuple[str, float, float]] | None = None,
) -> Schedule:
    """Checkpoint `devices` (default: those over `mem_limit`, or all without a limit) and tessellate.

    `mem_limit` is activation memory per device in the costs' memory unit (one number or one per
    device). `trace`, if given, receives (step, makespan, largest peak activation memory) for the
    start and every kept rewrite. Raises InfeasibleError if a device stays over the limit.
    """
    from pipeloom.sim.simulate import simulate

    refuse_pairs(schedule, "Mario")
    limits = _limits(mem_limit, schedule.num_devices)
    base = simulate(schedule, costs)
    if devices is None:
        over = [d for d, peak in enumerate(base.peak_activation_memory) if peak > limits[d] + _EPS]
        devices = over if mem_limit is not None else range(schedule.num_devices)
    current = schedule
    if trace is not None:
        trace.append(("input", base.makespan, max(base.peak_activation_memory)))
    if devices:
        current = apply_checkpoint(schedule, devices=set(devices), stages=stages)
        timeline = simulate(current, costs)
        if trace is not None:
            trace.append(("apply_checkpoint", timeline.makespan, max(timeline.peak_activation_memory)))
        if mem_limit is None:  # keep what checkpointing bought: no more full activations than it left
            limits = _checkpointed_budget(current, costs, timeline.peak_activation_memory)
        for _ in range(max_rounds):
            changed = False
            for name, rewrite in _PASSES:
                candidate = rewrite(current, costs, limits)
                if candidate.devices == current.devices:
                    continue
                result = simulate(candidate, costs)
                fits = all(peak <= limit + _EPS for peak, limit in zip(result.peak_activation_memory, limits))
                if result.makespan <= timeline.makespan + _EPS and fits:
                    current, timeline, changed = candidate, result, True
                    if trace is not None:
                        trace.append((name, result.makespan, max(result.peak_activation_memory)))
            if not changed:
                break
        peaks = timeline.peak_activation_memory
    else:
        peaks = base.peak_activation_memory
    for d, (peak, limit) in enumerate(zip(peaks, limits)):
        if peak > limit + _EPS:
            raise InfeasibleError(
                f"mario: device {d} needs {peak:g} of activation memory even with every forward there "
                f"checkpointed; the limit is {limit:g}"
            )
    return current.with_devices(current.devices, name=f"{schedule.name}+mario")


def _checkpointed_budget(schedule: Schedule, costs: Costs, peaks: list[float]) -> list[float]:
    """Per device: its peak right after checkpointing, with room for more kept inputs on top (up
    to every micro-batch's, but less than half an activation) — so forwards may be preposed (they
    hold only inputs), but no rewrite may keep more full activations alive than checkpointing
    left (Mario's M_θ per device)."""
    table = costs.resolve(schedule.num_devices, schedule.num_stages, schedule.num_slices)
    inputs = [
        schedule.num_microbatches * sum(table.M_ckpt[s * table.num_slices : (s + 1) * table.num_slices])
        for s in range(schedule.num_stages)
    ]
    full = [min(table.M_B[s * table.num_slices] for s in schedule.stages_on(d)) for d in range(schedule.num_devices)]
    return [
        peak + min(sum(inputs[s] for s in schedule.stages_on(d)), full[d] / 2)  # never room for one more
        for d, peak in enumerate(peaks)
    ]


def _limits(mem_limit: float | Sequence[float] | None, num_devices: int) -> list[float]:
    return per_device(mem_limit, num_devices, "mario")
