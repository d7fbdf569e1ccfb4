"""What the tuner can rule out without building a plan: lower bounds on a candidate's pipeline
time and on a schedule's memory that no pass chain can get under.

Both must be true lower bounds (tests/tune/test_search.py checks them against every simulated
step and every W-parts placement): one above the truth would prune plans that could win.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import simulate
from pipeloom.tune.space import Candidate

__all__ = ["ORDER_KEEPING", "memory_floor", "pipeline_floor", "room_floor"]


def pipeline_floor(candidate: Candidate, costs: Costs) -> float:
    """A lower bound on the pipeline's time: on each device, its own work after the earliest its
    first forward can start — one micro-batch's forwards (of its cheapest slice) through every
    stage before it. The busiest device's work alone would leave deep pipelines' warm-up out,
    and the tuner building schedules it could have ruled out."""
    share = 1 / candidate.replicas  # each replica sees its share of the micro-batches
    num_stages, slices = candidate.num_stages, candidate.slices
    sliced = costs.resolve(candidate.pp, num_stages, slices).F
    before = [0.0]
    for stage in range(num_stages):
        before.append(before[-1] + min(sliced[stage * slices : (stage + 1) * slices]))
    floors = []
    for stages_on in candidate.placement:
        work = sum(_micro_batch(costs, s) for s in stages_on)
        floors.append(min(before[s] for s in stages_on) + work * candidate.num_microbatches * share)
    return max(floors)


def _passes(costs: Costs, stage: int) -> tuple[float, float, float, float]:
    """`stage`'s forward and backward (B + W) with the backward apart, then with it fused
    (`Costs.F_BW` and `Costs.BW`, where priced apart; else the same)."""
    forward, backward = costs.stage_value("F", stage), costs.stage_value("B", stage) + costs.stage_value("W", stage)
    fused_forward = forward if costs.F_BW is None else costs.stage_value("F_BW", stage)
    fused_backward = backward if costs.BW is None else costs.stage_value("BW", stage)
    return forward, backward, fused_forward, fused_backward


def _micro_batch(costs: Costs, stage: int) -> float:
    """A micro-batch's forward and backward of `stage` at their cheapest: apart or fused."""
    forward, backward, fused_forward, fused_backward = _passes(costs, stage)
    return min(forward + backward, fused_forward + fused_backward)


def room_floor(candidate: Candidate, costs: Costs, room: Sequence[float]) -> float:
    """A lower bound on the pipeline's time when each device holds at most `room` of
    activations and no pass trades them for time (a budgeted scheme, order-keeping passes).
    From a micro-batch's forward of stage s starting to its backward of s starting, the device
    holds that forward's M_B, for at least the forward and the forwards and backwards of every
    later stage; from the backward starting to its W starting, M_W, for at least the backward.
    m such stretches per stage, all under the room at every instant: on each device the step is
    at least m·Σ (memory × stretch) / room — or, with one stage, m·stretch over the whole
    micro-batches the room holds at once. What keeps a memory-bound plan from being built only
    to lose: a tight budget caps the micro-batches in flight, not the work."""
    table = costs.resolve(candidate.pp, candidate.num_stages, candidate.slices)
    slices = candidate.slices
    after = [0.0] * (candidate.num_stages * slices)  # per (stage, slice): the later stages' F + B
    for stage in range(candidate.num_stages - 2, -1, -1):
        for slice_ in range(slices):
            index, later = stage * slices + slice_, (stage + 1) * slices + slice_
            after[index] = after[later] + table.F[later] + table.B[later]
    share = candidate.num_microbatches / candidate.replicas
    floors = [0.0]
    for device, stages_on in enumerate(candidate.placement):
        keys = [stage * slices + slice_ for stage in stages_on for slice_ in range(slices)]
        held = sum(table.M_B[k] * (table.F[k] + after[k]) + table.M_W[k] * table.B[k] for k in keys)
        if held <= 0:
            continue
        if room[device] <= 0:
            return math.inf
        floors.append(share * held / room[device])
        if len(keys) == 1 and table.M_B[keys[0]] > 0:
            at_once = math.floor(room[device] / table.M_B[keys[0]] + 1e-9)
            stretch = table.F[keys[0]] + after[keys[0]]
            floors.append(share * stretch / at_once if at_once else math.inf)
    # The bound holds for the schedule as built, each W apart; a W folded into its B after
    # (`fold_w_at_once`) makes that backward and its forward cheaper, and a makespan shrinks by no
    # more than its ops do: so at most by the least share a fused op keeps of the op it replaces.
    shares = [1.0]
    for stage in range(candidate.num_stages):
        forward, backward, fused_forward, fused_backward = _passes(costs, stage)
        shares += [
            fused / apart for fused, apart in ((fused_forward, forward), (fused_backward, backward)) if apart > 0
        ]
    return max(floors) * min(shares)


ORDER_KEEPING = {"wparts", "offload-all"}
"""Passes that keep every device's order of F and B: W parts only move W, and offloading the
optimizer moves no activation. A chain of them with W parts, the dearest pass, is skipped when
its schedule cannot fit whatever the parts do (`memory_floor`)."""


def memory_floor(schedule: Schedule, costs: Costs) -> list[float]:
    """Each device's peak (static and activations) if every B freed its activations whole (no
    M_W held for a W): whatever an order-keeping pass does with the W, the peak is no lower."""
    return simulate(schedule, dataclasses.replace(costs, M_W=0.0)).peak_memory
