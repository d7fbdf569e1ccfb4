"""The classic synchronous schedules: GPipe, 1F1B (DAPPLE) and Megatron's interleaved 1F1B.

Stage s of p contiguous stages runs on device s (GPipe, 1F1B); with v chunks per device,
stage s runs on device s mod p (interleaved). Backwards are fused (BW); split them with a pass.
"""

from __future__ import annotations

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.registry import Tuning, register, require_int

__all__ = ["gpipe", "one_f_one_b", "interleaved", "one_f_one_b_order"]

F, BW = OpKind.F, OpKind.BW


@register(
    "gpipe",
    family="classic",
    paper="Huang et al. 2019, GPipe",
    summary="all forwards, then all backwards; every micro-batch's activations live at once",
    domain="p >= 1, m >= 1",
    tuning=Tuning("gpipe", default=False),
    pareto="fixed",
)
def gpipe(num_devices: int, num_microbatches: int) -> Schedule:
    """GPipe: device d runs ``dF0 .. dF(m-1)`` then ``dBW0 .. dBW(m-1)``.

    p=2, m=2:  ``0F0 0F1 0BW0 0BW1`` / ``1F0 1F1 1BW0 1BW1``.
    """
    devices = [
        [Op(F, d, mb) for mb in range(num_microbatches)] + [Op(BW, d, mb) for mb in range(num_microbatches)]
        for d in range(num_devices)
    ]
    return Schedule.build("gpipe", devices, num_stages=num_devices, num_microbatches=num_microbatches)


@register(
    "1f1b",
    family="classic",
    paper="Fan et al. 2021, DAPPLE (PipeDream-Flush)",
    summary="warm-up forwards, then one forward one backward; device d holds at most p-d micro-batches",
    domain="p >= 1, m >= 1 (m < p runs all forwards of a device before its backwards)",
    tuning=Tuning("1f1b"),
    pareto="fixed",
)
def one_f_one_b(num_devices: int, num_microbatches: int) -> Schedule:
    """1F1B: device d warms up with ``p-d-1`` forwards, alternates F and BW, then drains.

    p=2, m=3:  ``0F0 0F1 0BW0 0F2 0BW1 0BW2`` / ``1F0 1BW0 1F1 1BW1 1F2 1BW2``.
    """
    devices = [
        one_f_one_b_order(
            [Op(F, d, mb) for mb in range(num_microbatches)],
            [Op(BW, d, mb) for mb in range(num_microbatches)],
            num_warmup=num_devices - d - 1,
        )
        for d in range(num_devices)
    ]
    return Schedule.build("1f1b", devices, num_stages=num_devices, num_microbatches=num_microbatches)


@register(
    "interleaved",
    family="classic",
    paper="Narayanan et al. 2021, Megatron-LM (interleaved 1F1B, virtual pipeline)",
    summary="v chunks per device, stage s on device s mod p; bubble shrinks by v",
    domain="p >= 1, v >= 1, m >= 1 and m a multiple of p when m > p",
    options=("num_chunks",),
    tuning=Tuning("interleaved", chunks=(2,), whole_rounds=True, fallbacks=(("trecomp",), ("mario",))),
    pareto="fixed",
)
def interleaved(num_devices: int, num_microbatches: int, num_chunks: int = 2) -> Schedule:
    """Megatron's interleaved 1F1B: micro-batches move through the chunks in groups of p.

    Forwards visit (chunk, micro-batch) group by group — chunk 0 for micro-batches 0..p-1, chunk 1
    for the same p, ... — and backwards the same way with chunks reversed. Device d warms up with
    ``2(p-d-1) + (v-1)·p`` forwards (Megatron's count), alternates F and BW, then drains.

    p=2, m=2, v=2::

        d0  0F0 0F1 2F0 2F1 2BW0 2BW1 0BW0 0BW1
        d1  1F0 1F1 3F0 3BW0 3F1 3BW1 1BW0 1BW1
    """
    p, m = num_devices, num_microbatches
    v = require_int("interleaved", "num_chunks (v)", num_chunks, 1)
    if m > p and m % p:
        raise ConfigError(
            f"interleaved: number of micro-batches ({m}) must be a multiple of the number of devices ({p}) "
            f"when it exceeds it; use m = {m - m % p} or {m + p - m % p}"
        )
    group = min(p, m)
    order = [(chunk, mb) for first in range(0, m, group) for chunk in range(v) for mb in range(first, first + group)]
    devices = []
    for d in range(p):
        forwards = [Op(F, chunk * p + d, mb) for chunk, mb in order]
        backwards = [Op(BW, (v - 1 - chunk) * p + d, mb) for chunk, mb in order]
        # Megatron's warm-up; with one chunk it is plain 1F1B's p-d-1.
        num_warmup = p - d - 1 if v == 1 else 2 * (p - d - 1) + (v - 1) * group
        devices.append(one_f_one_b_order(forwards, backwards, num_warmup=num_warmup))
    return Schedule.build("interleaved", devices, num_stages=v * p, num_microbatches=m)


def one_f_one_b_order(forwards: list[Op], backwards: list[Op], num_warmup: int) -> list[Op]:
    """Warm-up forwards, then (F, B) pairs, then the remaining backwards."""
    num_warmup = min(num_warmup, len(forwards))
    ops = forwards[:num_warmup]
    steady = len(forwards) - num_warmup
    for i in range(steady):
        ops.append(forwards[num_warmup + i])
        ops.append(backwards[i])
    ops.extend(backwards[steady:])
    return ops
