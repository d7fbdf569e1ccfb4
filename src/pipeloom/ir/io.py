"""The `pipeloom.schedule/1` JSON exchange format (docs/design.md §1), read and written exactly.

This is a public contract: other tools read these files. Readers ignore keys they do not know;
a change of meaning gets a new format string, never a silent edit. An overlapped F&B pair is its
two ops in order, the first with ``"overlap_next": true``: a reader that does not know the key
runs them one after the other, which is still a valid order of the same work. A forward-only
schedule (evaluation) carries ``"forward_only": true`` and holds F ops only; the key is left out
of training schedules.
"""

from __future__ import annotations

import json
from os import PathLike
from typing import Any

from pipeloom.errors import ScheduleError
from pipeloom.files import read_json
from pipeloom.ir.ops import OVERLAPPABLE, Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["FORMAT", "schedule_to_dict", "schedule_from_dict", "save_schedule", "load_schedule"]

FORMAT = "pipeloom.schedule/1"
_SIZE_KEYS = ("num_devices", "num_stages", "num_microbatches", "num_slices")


def op_to_dict(op: Op) -> dict[str, Any]:
    entry: dict[str, Any] = {"op": op.kind.value, "stage": op.stage, "mb": op.microbatch, "slice": op.slice}
    if op.kind is OpKind.F:
        entry["ckpt"] = op.ckpt
    if op.after_grad:
        entry["after_grad"] = True
    if op.parts != 1:
        entry["part"] = op.part
        entry["parts"] = op.parts
    if op.overlap_next:
        entry["overlap_next"] = True
    return entry


def schedule_to_dict(schedule: Schedule) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "name": schedule.name,
        "num_devices": schedule.num_devices,
        "num_stages": schedule.num_stages,
        "num_microbatches": schedule.num_microbatches,
        "num_slices": schedule.num_slices,
        "devices": [[op_to_dict(op) for op in ops] for ops in schedule.devices],
        **({"forward_only": True} if schedule.forward_only else {}),
    }


def save_schedule(schedule: Schedule, path: str | PathLike[str]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(schedule_to_dict(schedule), handle, separators=(",", ":"))
        handle.write("\n")


def load_schedule(path: str | PathLike[str]) -> Schedule:
    """Read a `pipeloom.schedule/1` file, or the schedule a plan (`pipeloom.plan/1`, `tune
    --output`) runs; any problem is a one-line ScheduleError naming the file."""
    data = read_json(path, "schedule", ScheduleError)
    if isinstance(data, dict) and data.get("format") == "pipeloom.plan/1":
        data = data.get("schedule")
    try:
        return schedule_from_dict(data)
    except ScheduleError as error:
        raise ScheduleError(f"schedule file {str(path)!r}: {error.message}", error.details) from None


def schedule_from_dict(data: Any) -> Schedule:
    if not isinstance(data, dict):
        raise ScheduleError(f'expected a JSON object with "format": "{FORMAT}"')
    if data.get("format") != FORMAT:
        raise ScheduleError(f"unsupported format {data.get('format')!r}; this reader understands {FORMAT!r}")
    sizes = {}
    for key in _SIZE_KEYS:
        value = data.get(key, 1 if key == "num_slices" else None)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ScheduleError(f"{key} must be a positive integer, got {value!r}")
        sizes[key] = value
    devices = data.get("devices")
    if not isinstance(devices, list) or len(devices) != sizes["num_devices"]:
        raise ScheduleError(f'"devices" must be a list of {sizes["num_devices"]} op lists (num_devices)')
    op_lists = []
    for device, entries in enumerate(devices):
        if not isinstance(entries, list):
            raise ScheduleError(f"device {device}: expected a list of ops")
        op_lists.append([_op_from_dict(entry, device, step) for step, entry in enumerate(entries)])
    return Schedule.build(
        str(data.get("name", "schedule")),
        op_lists,
        num_stages=sizes["num_stages"],
        num_microbatches=sizes["num_microbatches"],
        num_slices=sizes["num_slices"],
        forward_only=_flag(data, "forward_only"),
    )


def _flag(data: dict, key: str) -> bool:
    value = data.get(key, False)
    if not isinstance(value, bool):
        raise ScheduleError(f"{key!r} must be true or false, got {value!r}")
    return value


def _op_from_dict(entry: Any, device: int, step: int) -> Op:
    where = f"device {device} step {step}"
    if not isinstance(entry, dict):
        raise ScheduleError(f"{where}: expected an op object, got {entry!r}")
    try:
        kind = OpKind(str(entry.get("op")))
    except ValueError:
        raise ScheduleError(f"{where}: unknown op {entry.get('op')!r} (expected one of F, B, W, BW, R)") from None

    def integer(key: str, default: int | None) -> int:
        value = entry.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ScheduleError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
        return value

    ckpt = entry.get("ckpt", False)
    if not isinstance(ckpt, bool):
        raise ScheduleError(f"{where}: 'ckpt' must be true or false, got {ckpt!r}")
    if ckpt and kind is not OpKind.F:
        raise ScheduleError(f"{where}: only a forward (F) can be checkpointed")
    after_grad = entry.get("after_grad", False)
    if not isinstance(after_grad, bool):
        raise ScheduleError(f"{where}: 'after_grad' must be true or false, got {after_grad!r}")
    if after_grad and kind is not OpKind.R:
        raise ScheduleError(f"{where}: only a recompute (R) can wait for its backward's gradient (after_grad)")
    overlap_next = entry.get("overlap_next", False)
    if not isinstance(overlap_next, bool):
        raise ScheduleError(f"{where}: 'overlap_next' must be true or false, got {overlap_next!r}")
    if overlap_next and kind not in OVERLAPPABLE:
        raise ScheduleError(f"{where}: only a forward or a backward (F, B, BW) can overlap the next op")
    parts = integer("parts", 1)
    part = integer("part", 0)
    if parts != 1 and kind is not OpKind.W:
        raise ScheduleError(f"{where}: only a weight-gradient op (W) can be cut into parts")
    if parts < 1 or part >= parts:
        raise ScheduleError(f"{where}: part {part} of {parts} is not a valid part index")
    return Op(
        kind,
        integer("stage", None),
        integer("mb", None),
        integer("slice", 0),
        ckpt,
        part,
        parts,
        after_grad,
        overlap_next,
    )
