"""Forward-only schedules: evaluation and inference through the pipeline, nothing kept for a backward.

`forward` is GPipe without its backwards: device d runs stage d's forward of every micro-batch in
turn, each handing its output on and keeping nothing. `forward_only_of` is the forward-only twin
of a training schedule: each device's forwards in that schedule's order, on the same devices —
what a run's evaluation executes, since every rank already holds those stages. Keeping only
forwards keeps a valid order valid: a cycle among them would be one in the full schedule.
"""

from __future__ import annotations

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.registry import register

__all__ = ["forward", "forward_only_of"]


@register(
    "forward",
    family="classic",
    paper="Huang et al. 2019, GPipe (its forward pass alone)",
    summary="every micro-batch's forward, stage after stage, nothing kept: evaluation and inference",
    domain="p >= 1, m >= 1",
    not_tuned="a forward-only schedule trains nothing; `train --eval-data` runs one beside the training schedule",
    pareto=None,
)
def forward(num_devices: int, num_microbatches: int) -> Schedule:
    """Device d runs ``dF0 .. dF(m-1)``.

    >>> forward(2, 2).to_text().splitlines()[1:]
    ['0F0 0F1', '1F0 1F1']
    """
    devices = [[Op(OpKind.F, d, mb) for mb in range(num_microbatches)] for d in range(num_devices)]
    return Schedule.build(
        "forward", devices, num_stages=num_devices, num_microbatches=num_microbatches, forward_only=True
    )


def forward_only_of(schedule: Schedule) -> Schedule:
    """`schedule`'s forwards, device by device in its order, none checkpointed and none paired.

    >>> from pipeloom.schedules.classic import one_f_one_b
    >>> forward_only_of(one_f_one_b(2, 3)).to_text().splitlines()[1:]
    ['0F0 0F1 0F2', '1F0 1F1 1F2']
    """
    devices = [
        [Op(OpKind.F, op.stage, op.microbatch, op.slice) for op in ops if op.kind is OpKind.F]
        for ops in schedule.devices
    ]
    return Schedule.build(
        f"{schedule.name} (forward only)",
        devices,
        num_stages=schedule.num_stages,
        num_microbatches=schedule.num_microbatches,
        num_slices=schedule.num_slices,
        forward_only=True,
    )
