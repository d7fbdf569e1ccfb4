"""What the tuner can rule out without building a plan: lower bounds on a candidate's pipeline
time and on a schedule's memory that no pass chain can get under.

Both must be true lower bounds (tests/tune/test_search.py checks them against every simulated
step and every W-parts placement): one above the truth would prune plans that could win.
"""

from __future__ import annotations

import dataclasses

from pipeloom.costs import Costs
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import simulate
from pipeloom.tune.space import Candidate

__all__ = ["ORDER_KEEPING", "memory_floor", "pipeline_floor"]


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
        work = sum(costs.stage_value(kind, s) for s in stages_on for kind in ("F", "B", "W"))
        floors.append(min(before[s] for s in stages_on) + work * candidate.num_microbatches * share)
    return max(floors)


ORDER_KEEPING = {"wparts", "offload-all"}
"""Passes that keep every device's order of F and B: W parts only move W, and offloading the
optimizer moves no activation. A chain of them with W parts, the dearest pass, is skipped when
its schedule cannot fit whatever the parts do (`memory_floor`)."""


def memory_floor(schedule: Schedule, costs: Costs) -> list[float]:
    """Each device's peak (static and activations) if every B freed its activations whole (no
    M_W held for a W): whatever an order-keeping pass does with the W, the peak is no lower."""
    return simulate(schedule, dataclasses.replace(costs, M_W=0.0)).peak_memory
