"""torch.distributed.pipelining's CSV action format, both ways, so a plan can run on torch's runtime.

torch writes one row per pipeline rank, each cell an action ``{stage}{type}{microbatch}``:
F forward, I backward w.r.t. the input, W backward w.r.t. the weights, B full backward; empty
cells are idle slots. That is pipeloom's IR with I for B and B for BW
(`_PipelineScheduleRuntime._load_csv(path, format="compute_only")` reads it). Checkpointing,
slices and W parts have no torch action and are refused on export. On import, communication and
sharding actions (SEND_F, RECV_B, UNSHARD, REDUCE_GRAD, ...) are dropped — pipeloom derives its
messages from the order. An overlapped pair (``0F3&1BW2``) is torch's ``(0F3;1B2)OVERLAP_F_B``
cell, both ways.

The CSV says which rank runs each stage, but the engine builds each rank's stage modules by a
placement of its own: "loop" (stage s on rank s mod p: 1F1B, interleaved, the ZB-H family) or
"v" (ranks 0..p-1 down, then p-1..0 back: ZB-V, DualPipeV). A CSV whose stages sit elsewhere is
accepted and then fails at its first step (a receive timeout, a size mismatch, a hang on NCCL),
so `check_placement` refuses it first. Its mapping is torch's `generate_stage_to_rank_mapping`,
written here because the planning core imports no torch (a test compares the two). A schedule
with a stage on two ranks (Chimera's and DualPipe's two copies) has no placement at all.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace

from pipeloom.errors import ConfigError, ScheduleError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["PLACEMENTS", "check_placement", "from_torch_csv", "placement_of", "stage_ranks", "to_torch_csv"]

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
        raise ConfigError(
            f"{schedule.name!r} has slices, which torch.distributed.pipelining cannot express{_instead(schedule)}"
        )
    _one_rank_a_stage(schedule)
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


PLACEMENTS = ("loop", "v")
_NEAREST = {"chimera": "interleaved", "dualpipe": "dualpipev", "svpp": "interleaved", "terapipe": "gpipe"}
"""What to export instead of a scheme torch cannot express: DualPipe's one-copy form; for Chimera
and SVPP the interleaved 1F1B, which also shrinks the bubble by holding more stages a rank; for
TeraPipe GPipe, its schedule without the slices."""


def _instead(schedule: Schedule) -> str:
    """'; export X instead' for a scheme in `_NEAREST` (passes append '+pass' to the name)."""
    nearest = _NEAREST.get(schedule.name.split("+")[0])
    return f"; export {nearest!r} instead" if nearest else ""


def stage_ranks(num_ranks: int, num_stages: int, placement: str) -> list[int]:
    """The rank of each stage under torch's named placement (`generate_stage_to_rank_mapping`).

    >>> stage_ranks(2, 4, "loop"), stage_ranks(2, 4, "v")
    ([0, 1, 0, 1], [0, 1, 1, 0])
    """
    if placement not in PLACEMENTS:
        raise ConfigError(f"placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    if placement == "loop":
        return [stage % num_ranks for stage in range(num_stages)]
    if num_stages % num_ranks:
        raise ConfigError(f"the v placement needs whole rounds of ranks: {num_stages} stages over {num_ranks} ranks")
    ranks, rank = [], 0
    for stage in range(num_stages):
        ranks.append(rank)
        if (stage + 1) % num_ranks:  # at a turn the V stays on its rank
            rank += 1 if (stage // num_ranks) % 2 == 0 else -1
    return ranks


def _one_rank_a_stage(schedule: Schedule) -> list[int]:
    """Each stage's rank; ConfigError if a stage runs on two (a second copy of the model)."""
    where: dict[int, set[int]] = {}
    for device in range(schedule.num_devices):
        for stage in schedule.stages_on(device):
            where.setdefault(stage, set()).add(device)
    for stage, devices in sorted(where.items()):
        if len(devices) > 1:
            raise ConfigError(
                f"{schedule.name!r} runs stage {stage} on ranks {sorted(devices)} (two copies of the model); "
                f"torch.distributed.pipelining, torchtitan and Megatron-LM place each stage on one rank{_instead(schedule)}"
            )
    return [min(where[stage]) for stage in range(schedule.num_stages)]


def placement_of(schedule: Schedule) -> str:
    """The named placement the schedule's stages sit in ("loop" where both fit: one stage a rank);
    ConfigError if none."""
    ranks = _one_rank_a_stage(schedule)
    for placement in PLACEMENTS:
        if placement == "v" and schedule.num_stages % schedule.num_devices:
            continue  # the v placement turns only after a whole round of ranks
        if ranks == stage_ranks(schedule.num_devices, schedule.num_stages, placement):
            return placement
    raise ConfigError(
        f"{schedule.name!r} puts its stages on ranks {ranks}, which neither torch placement "
        f"({', '.join(PLACEMENTS)}) does"
    )


def check_placement(schedule: Schedule, placement: str) -> None:
    """ConfigError, naming the first misplaced stage, unless every stage of `schedule` sits on
    the rank that `placement` gives it."""
    ranks = _one_rank_a_stage(schedule)
    wanted = stage_ranks(schedule.num_devices, schedule.num_stages, placement)
    for stage, (rank, rank_wanted) in enumerate(zip(ranks, wanted)):
        if rank != rank_wanted:
            try:
                fits = f"; it fits the {placement_of(schedule)} placement"
            except ConfigError:
                fits = ""
            raise ConfigError(
                f"{schedule.name!r} runs stage {stage} on rank {rank}, but the {placement} placement puts it "
                f"on rank {rank_wanted}{fits}"
            )
