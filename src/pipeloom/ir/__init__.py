"""The schedule IR: ops, schedules, their text and JSON forms, and validation."""

from pipeloom.ir.io import FORMAT, load_schedule, save_schedule
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.text import parse_op, render_grid
from pipeloom.ir.validate import validate

__all__ = [
    "FORMAT",
    "Op",
    "OpKind",
    "Schedule",
    "load_schedule",
    "parse_op",
    "render_grid",
    "save_schedule",
    "validate",
]
