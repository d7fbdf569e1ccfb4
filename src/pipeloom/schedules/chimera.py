"""Chimera: two pipelines in opposite directions over the same devices (Li & Hoefler, SC'21).

The *down* pipeline places stage s on device s, the *up* pipeline on device p-1-s, so every
device holds two stages (weights replicated: static memory counts both) and each pipeline's
warm-up and drain fill the other's bubbles. Micro-batches come in units of p: the first half of
a unit goes down, the second half up. Each pipeline runs 1F1B over its micro-batches, and the
two orders are merged on each device by list scheduling that alternates between the pipelines
whenever both can run — which reproduces the paper's basic unit (D−2 bubbles when F = B).

Memory: with m ≤ p a device holds between (p/2+1)·M_B (the ends) and p·M_B (the middle), Mario
Table 1. With more micro-batches, units are concatenated without a flush between them (the next
unit's forwards fill the previous unit's drain). Run as two plain 1F1B pipelines, stage s of one
holds p−s micro-batches and stage p−1−s of the other s+1, so every device would hold (p+1)·M_B.
`chimera` keeps Table 1's bound D·M_B: on each device the pipeline that reaches it first (down on
the first half of the devices, up on the second) warms up one forward fewer once units are
concatenated. Its forwards then wait for a backward, which costs nothing when F = B or B = 2F
without comm (the other pipeline fills the slot) and up to about 12 % with comm or uneven B/F;
`chimera-eager` keeps the p+1 warm-up for that speed.
"""

from __future__ import annotations

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.classic import one_f_one_b_order
from pipeloom.schedules.merge import merge_queues
from pipeloom.schedules.registry import Tuning, register

__all__ = ["chimera", "chimera_eager"]

# The nominal durations the merge lays the two pipelines out with: a backward takes two forwards.
_NOMINAL_DURATION = {OpKind.F: 1.0, OpKind.BW: 2.0}


@register(
    "chimera",
    family="chimera",
    paper="Li & Hoefler 2021, Chimera: bidirectional pipelines",
    summary="down and up pipelines superposed, weights replicated twice; fewer bubbles than 1F1B; "
    "at most p micro-batches per device (Mario Table 1)",
    domain="p even >= 2, m even >= 2",
    tuning=Tuning("chimera", layout="mirrored", even=True, min_devices=2),
    pareto="fixed",
)
def chimera(num_devices: int, num_microbatches: int) -> Schedule:
    """Chimera with the down pipeline on stages 0..p-1 = devices 0..p-1 and the up one reversed.

    p=4, m=4 (mbs 0, 1 down; 2, 3 up)::

        d0  0F0 0F1 3F2 3BW2 3F3 3BW3 0BW0 0BW1
        d1  1F0 2F2 1F1 2F3 2BW2 1BW0 2BW3 1BW1
        d2  1F2 2F0 1F3 2F1 2BW0 1BW2 2BW1 1BW3
        d3  0F2 0F3 3F0 3BW0 3F1 3BW1 0BW2 0BW3
    """
    return _chimera("chimera", num_devices, num_microbatches, bounded=True)


@register(
    "chimera-eager",
    family="chimera",
    paper="Li & Hoefler 2021, Chimera: bidirectional pipelines",
    summary="chimera whose devices hold p+1 micro-batches once m > p (D with `chimera`), for fewer bubbles under comm",
    domain="p even >= 2, m even >= 2",
    not_tuned="chimera's order with one more micro-batch in flight; compare it with `pipeloom compare`",
)
def chimera_eager(num_devices: int, num_microbatches: int) -> Schedule:
    """Chimera with each pipeline's full 1F1B warm-up; the same as `chimera` when m ≤ p."""
    return _chimera("chimera-eager", num_devices, num_microbatches, bounded=False)


def _chimera(name: str, p: int, m: int, bounded: bool) -> Schedule:
    if p % 2:
        raise ConfigError(f"{name}: number of devices ({p}) must be even (two pipelines of p stages share them)")
    if m % 2:
        raise ConfigError(
            f"{name}: number of micro-batches ({m}) must be even (half go down, half go up); use {max(m - 1, 2)} or {m + 1}"
        )
    unit_start = [mb - mb % p for mb in range(m)]
    goes_down = [mb - first < min(p, m - first) // 2 for mb, first in enumerate(unit_start)]
    down_mbs = [mb for mb in range(m) if goes_down[mb]]
    up_mbs = [mb for mb in range(m) if not goes_down[mb]]
    queues = []
    for device in range(p):
        down_stage, up_stage = device, p - 1 - device
        fewer_down = bounded and m > p and device < p // 2
        fewer_up = bounded and m > p and device >= p // 2
        queues.append(
            [
                _pipeline_order(down_stage, down_mbs, p - down_stage - 1 - fewer_down),
                _pipeline_order(up_stage, up_mbs, p - up_stage - 1 - fewer_up),
            ]
        )
    return merge_queues(
        name,
        queues,
        num_stages=p,
        num_microbatches=m,
        duration=lambda op: _NOMINAL_DURATION[op.kind],
    )


def _pipeline_order(stage: int, microbatches: list[int], num_warmup: int) -> list[Op]:
    """One pipeline's 1F1B order for `stage`."""
    return one_f_one_b_order(
        [Op(OpKind.F, stage, mb) for mb in microbatches],
        [Op(OpKind.BW, stage, mb) for mb in microbatches],
        num_warmup=max(num_warmup, 0),
    )
