"""torch.distributed.pipelining's CSV action format, both ways, so a plan can run on torch's runtime.

torch writes one row per pipeline rank, each cell an action ``{stage}{type}{microbatch}``:
F forward, I backward w.r.t. the input, W backward w.r.t. the weights, B full backward; empty
cells are idle slots. That is pipeloom's IR with I for B and B for BW
(`_PipelineScheduleRuntime._load_csv(path, format="compute_only")` reads it). Checkpointing,
slices and W parts have no torch action and are refused on export. On import, communication and
sharding actions (SEND_F, RECV_B, UNSHARD, REDUCE_GRAD, ...) are dropped — pipeloom derives its
messages from the order. An overlapped pair (``0F3&1BW2``) is torch's ``(0F3;1B2)OVERLAP_F_B``
cell, both ways.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace

from pipeloom.errors import ConfigError, ScheduleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["to_torch_csv", "from_torch_csv"]

_TO_TORCH = {OpKind.F: "F", OpKind.B: "I", OpKind.W: "W", OpKind.BW: "B"}
_FROM_TORCH = {"F": OpKind.F, "I": OpKind.B, "W": OpKind.W, "B": OpKind.BW}
_ACTION = re.compile(r"^(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)$")


def to_torch_csv(schedule: Schedule) -> str:
    """One CSV row per device: the schedule's ops as torch actions.

    >>> from pipeloom.schedules import build_schedule
    >>> print(to_torch_csv(build_schedule("zb-h1", 2, 2)), end="")
    0F0,0F1,0I0,0W0,0I1,0W1
    1F0,1I0,1F1,1I1,1W0,1W1
    """
    if schedule.num_slices != 1:
        raise ConfigError(f"{schedule.name!r} has slices, which torch.distributed.pipelining cannot express")
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for device, ops in enumerate(schedule.devices):
        row: list[str] = []
        pair_head = None
        for op in ops:
            if op.kind is OpKind.R or op.ckpt:
                raise ConfigError(
                    f"{schedule.name!r} checkpoints ({op.text} on device {device}); torch's CSV has no recompute action"
                )
            if op.parts != 1:
                raise ConfigError(
                    f"{schedule.name!r} cuts W into parts ({op.text}); torch's CSV has one W per micro-batch"
                )
            action = f"{op.stage}{_TO_TORCH[op.kind]}{op.microbatch}"
            if op.overlap_next:
                pair_head = action
            elif pair_head is not None:
                row.append(f"({pair_head};{action})OVERLAP_F_B")
                pair_head = None
            else:
                row.append(action)
        writer.writerow(row)
    return buffer.getvalue()


def from_torch_csv(text: str, name: str = "torch") -> Schedule:
    """A pipeloom schedule from torch's CSV (compute_only or compute_comms), validated."""
    devices: list[list[Op]] = []
    for line, row in enumerate(csv.reader(io.StringIO(text)), 1):
        ops: list[Op] = []
        for cell in row:
            actions = _expand(cell.strip(), line)
            computed = [op for op in (_compute(action, line) for action in actions) if op is not None]
            if len(actions) > 1 and len(computed) != 2:
                raise ConfigError(f"torch CSV row {line}: {cell.strip()!r} must overlap exactly two compute actions")
            if len(actions) > 1:
                computed[0] = replace(computed[0], overlap_next=True)
            ops += computed
        devices.append(ops)
    ops_all = [op for ops in devices for op in ops]
    if not ops_all:
        raise ConfigError("torch CSV holds no compute action")
    schedule = Schedule.build(
        name,
        devices,
        num_stages=max(op.stage for op in ops_all) + 1,
        num_microbatches=max(op.microbatch for op in ops_all) + 1,
    )
    try:
        return schedule.validate()
    except ScheduleError as error:
        raise ScheduleError(
            f"the torch CSV does not describe a valid schedule: {error.summary}", error.details
        ) from None


def _compute(action: str, line: int) -> Op | None:
    """The op of a compute action; None for communication and sharding actions."""
    match = _ACTION.match(action)
    if not match:
        raise ConfigError(f"torch CSV row {line}: {action!r} is not an action like 2F0, 1I3 or 0W5")
    stage, kind, microbatch = match.groups()
    if kind not in _FROM_TORCH:
        return None
    if not microbatch:
        raise ConfigError(f"torch CSV row {line}: {action!r} names no micro-batch")
    return Op(_FROM_TORCH[kind], int(stage), int(microbatch))


def _expand(cell: str, line: int) -> list[str]:
    """'' → []; '(0F1;1I0)OVERLAP_F_B' → ['0F1', '1I0']; anything else → [cell]."""
    if not cell:
        return []
    if cell.startswith("("):
        inner, _, kind = cell[1:].partition(")")
        if kind != "OVERLAP_F_B":
            raise ConfigError(f"torch CSV row {line}: {cell!r} is not an OVERLAP_F_B group")
        return [part.strip() for part in inner.split(";") if part.strip()]
    return [cell]
