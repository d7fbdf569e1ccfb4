"""The compact text form of ops and schedules, and the device×step grid.

The op form follows torch.distributed.pipelining's actions (``"2F0"`` = stage 2, forward,
micro-batch 0) so that schedules read the same in both tools; see `Op` for the extensions
(slices, checkpointing, W parts). A schedule is one line per device, ops separated by blanks,
under an optional header line that fixes the name and sizes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pipeloom.errors import ScheduleError
from pipeloom.ir.ops import OVERLAPPABLE, Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["parse_op", "schedule_to_text", "schedule_from_text", "render_grid"]

_OP_RE = re.compile(r"^(\d+)(BW|F|B|W|R)(\d+)(?:\.(\d+))?(c)?(g)?(?::(\d+)/(\d+))?(&)?$")
_HEADER_RE = re.compile(r"^#\s*pipeloom\b(.*)$")
_EMPTY_DEVICE = "-"
_PAIR_SPLIT = re.compile(r"(?<=&)(?=.)")  # "0F3&5BW1" → "0F3&", "5BW1"


def parse_op(text: str) -> Op:
    """Parse ``2F0``, ``2F0c``, ``0W5:1/3``, ``3F1.2``, ``0F3&``... into an Op (inverse of `Op.text`)."""
    match = _OP_RE.match(text.strip())
    if not match:
        raise ScheduleError(
            f"cannot parse op {text!r}: expected <stage><F|B|W|BW|R><microbatch>[.<slice>][c][g][:<part>/<parts>], "
            "e.g. 2F0, or an overlapped pair such as 0F3&5BW1"
        )
    stage, kind, microbatch, slice_, ckpt, after_grad, part, parts, overlap = match.groups()
    op = Op(
        OpKind(kind),
        int(stage),
        int(microbatch),
        int(slice_ or 0),
        ckpt is not None,
        int(part or 0),
        int(parts or 1),
        after_grad is not None,
        overlap is not None,
    )
    if op.after_grad and op.kind is not OpKind.R:
        raise ScheduleError(f"op {text!r}: only a recompute (R) can wait for its backward's gradient (g)")
    if op.ckpt and op.kind is not OpKind.F:
        raise ScheduleError(f"op {text!r}: only a forward (F) can be checkpointed")
    if op.parts != 1 and op.kind is not OpKind.W:
        raise ScheduleError(f"op {text!r}: only a weight-gradient op (W) can be cut into parts")
    if op.overlap_next and op.kind not in OVERLAPPABLE:
        raise ScheduleError(f"op {text!r}: only a forward or a backward (F, B, BW) can overlap another op (&)")
    if not 0 <= op.part < op.parts:
        raise ScheduleError(f"op {text!r}: part {op.part} is outside 0..{op.parts - 1}")
    return op


def schedule_to_text(schedule: Schedule) -> str:
    header = (
        f"# pipeloom name={schedule.name} stages={schedule.num_stages} "
        f"microbatches={schedule.num_microbatches} slices={schedule.num_slices}"
    )
    lines = [
        "".join(op.text + ("" if op.overlap_next else " ") for op in ops).rstrip() or _EMPTY_DEVICE
        for ops in schedule.devices
    ]
    return "\n".join([header, *lines]) + "\n"


def schedule_from_text(text: str, name: str | None = None) -> Schedule:
    """Read the text form; sizes come from the header, else from the largest indices used."""
    header: dict[str, str] = {}
    devices: list[list[Op]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if line.startswith("#"):
            match = _HEADER_RE.match(line)
            if match:
                header.update(_parse_header(match.group(1)))
            continue
        tokens = line.split()
        if tokens == [_EMPTY_DEVICE]:
            devices.append([])
            continue
        devices.append([parse_op(piece) for token in tokens for piece in _PAIR_SPLIT.split(token)])
    if not devices:
        raise ScheduleError("text schedule has no device lines")
    all_ops = [op for ops in devices for op in ops]

    def size(field: str, attribute: str) -> int:
        if field in header:
            return _positive_int(header[field], field)
        return max((getattr(op, attribute) for op in all_ops), default=0) + 1

    return Schedule.build(
        name or header.get("name", "text"),
        devices,
        num_stages=size("stages", "stage"),
        num_microbatches=size("microbatches", "microbatch"),
        num_slices=size("slices", "slice"),
    )


def _parse_header(rest: str) -> dict[str, str]:
    fields = {}
    for token in rest.split():
        key, sep, value = token.partition("=")
        if not sep:
            raise ScheduleError(f"text schedule header: expected key=value, got {token!r}")
        fields[key] = value
    return fields


def _positive_int(value: str, field: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise ScheduleError(f"text schedule header: {field} must be a positive integer, got {value!r}")
    return int(value)


# ---------------------------------------------------------------------------------------------
# The grid: rows are devices, columns are steps (positions in the device's list).

_CONTEXT_STEPS = 4  # steps shown either side of a marked cell when the grid is too wide
_MAX_FULL_STEPS = 32
_MAX_FULL_DEVICES = 24
_MAX_FOCUS_STEPS = 6  # windows drawn around at most this many marked steps


def render_grid(schedule: Schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """Render the device×step grid; cells in `marks` ((device, step) pairs) are [bracketed].

    Large schedules show only the steps (and devices) around the marks, with gaps drawn as ``…``.
    """
    marked = set(marks)
    num_steps = max((len(ops) for ops in schedule.devices), default=0)
    focus_steps = sorted({step for _, step in marked})[:_MAX_FOCUS_STEPS]
    steps = _visible(num_steps, focus_steps, _MAX_FULL_STEPS, _CONTEXT_STEPS)
    rows = _visible(schedule.num_devices, sorted({device for device, _ in marked}), _MAX_FULL_DEVICES, 1)
    width = max((len(op.text) for ops in schedule.devices for op in ops), default=1) + 2
    label_width = len(f"d{schedule.num_devices - 1}") + 1

    def line(label: str, cells: list[str]) -> str:
        return (label.ljust(label_width) + "".join(cells)).rstrip()

    out = [line("step", ["…".center(width) if step is None else str(step).center(width) for step in steps])]
    for device in rows:
        if device is None:
            out.append("…")
            continue
        ops = schedule.devices[device]
        cells = []
        for step in steps:
            if step is None:
                cells.append("…".center(width))
            elif step >= len(ops):
                cells.append(" " * width)
            elif (device, step) in marked:
                cells.append(f"[{ops[step].text}]".center(width))
            else:
                cells.append(ops[step].text.center(width))
        out.append(line(f"d{device}", cells))
    return "\n".join(out)


def _visible(count: int, focus: list[int], limit: int, context: int) -> list[int | None]:
    """Indices to show: all when few, else windows around `focus` with None for each gap."""
    if count <= limit or not focus:
        return list(range(min(count, limit))) + ([None] if count > limit else [])
    shown = sorted({i for f in focus for i in range(f - context, f + context + 1) if 0 <= i < count})
    out: list[int | None] = []
    for i in shown:
        if (out and out[-1] is not None and i != out[-1] + 1) or (not out and i != 0):
            out.append(None)
        out.append(i)
    if shown[-1] != count - 1:
        out.append(None)
    return out
