"""Schedule: per-device ordered op lists, the one representation every part of pipeloom shares.

Placement is data, not formula: stage s of micro-batch m lives on whichever device's list holds
its F. That one fact lets a single dependency rule serve 1F1B, interleaved, V-shapes and Chimera
(whose two pipelines put the same stage on two devices, for different micro-batches).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from os import PathLike

from pipeloom.errors import ScheduleError
from pipeloom.ir.ops import Op, OpKind

__all__ = ["Schedule"]


@dataclass(frozen=True, slots=True)
class Schedule:
    """What each device runs, in order.

    Sizes are explicit (not inferred from the ops) so that an incomplete schedule is
    reported as incomplete rather than silently read as a smaller one.
    """

    name: str
    num_devices: int
    num_stages: int
    num_microbatches: int
    num_slices: int
    devices: tuple[tuple[Op, ...], ...]
    forward_only: bool = False
    """Forwards only, nothing kept for a backward (evaluation, inference): every key needs its F
    and nothing else, and an F holds no activations once it ends."""
    _graph: object = field(default=None, init=False, repr=False, compare=False)
    """The dependency graph, built once: a schedule is immutable, and the tuner simulates one
    schedule under many costs (static-memory measures, pass candidates)."""

    def __getstate__(self):
        """Without the graph: a copy rebuilds it faster than the pickle would carry it."""
        return (
            self.name,
            self.num_devices,
            self.num_stages,
            self.num_microbatches,
            self.num_slices,
            self.devices,
            self.forward_only,
        )

    def __setstate__(self, state) -> None:
        names = ("name", "num_devices", "num_stages", "num_microbatches", "num_slices", "devices", "forward_only")
        for name, value in zip(names, state):
            object.__setattr__(self, name, value)
        object.__setattr__(self, "_graph", None)

    def __post_init__(self) -> None:
        for size in ("num_devices", "num_stages", "num_microbatches", "num_slices"):
            value = getattr(self, size)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ScheduleError(f"schedule {self.name!r}: {size} must be a positive integer, got {value!r}")
        if len(self.devices) != self.num_devices:
            raise ScheduleError(
                f"schedule {self.name!r}: num_devices is {self.num_devices} but {len(self.devices)} device lists were given"
            )

    @classmethod
    def build(
        cls,
        name: str,
        devices: Sequence[Iterable[Op]],
        *,
        num_stages: int,
        num_microbatches: int,
        num_slices: int = 1,
        forward_only: bool = False,
    ) -> Schedule:
        """Freeze per-device op lists (any iterables) into a Schedule."""
        frozen = tuple(tuple(ops) for ops in devices)
        return cls(name, len(frozen), num_stages, num_microbatches, num_slices, frozen, forward_only)

    def with_devices(self, devices: Sequence[Iterable[Op]], name: str | None = None) -> Schedule:
        """The same sizes with new op lists: what a pass returns."""
        frozen = tuple(tuple(ops) for ops in devices)
        return replace(self, devices=frozen, num_devices=len(frozen), name=self.name if name is None else name)

    @property
    def num_ops(self) -> int:
        return sum(len(ops) for ops in self.devices)

    def ops(self) -> Iterator[tuple[int, int, Op]]:
        """Every op as (device, step, op), device by device."""
        for device, ops in enumerate(self.devices):
            for step, op in enumerate(ops):
                yield device, step, op

    def stages_on(self, device: int) -> list[int]:
        """Stages whose forward runs on `device`, sorted: the model partitions it must hold."""
        return sorted({op.stage for op in self.devices[device] if op.kind is OpKind.F})

    # Conversions live in their own modules; these are the public spellings.
    def to_text(self) -> str:
        from pipeloom.ir.text import schedule_to_text

        return schedule_to_text(self)

    @classmethod
    def from_text(cls, text: str, name: str | None = None) -> Schedule:
        from pipeloom.ir.text import schedule_from_text

        return schedule_from_text(text, name=name)

    def to_dict(self) -> dict:
        from pipeloom.ir.io import schedule_to_dict

        return schedule_to_dict(self)

    @classmethod
    def from_dict(cls, data: dict) -> Schedule:
        from pipeloom.ir.io import schedule_from_dict

        return schedule_from_dict(data)

    def to_json(self, path: str | PathLike[str]) -> None:
        from pipeloom.ir.io import save_schedule

        save_schedule(self, path)

    def validate(self) -> Schedule:
        """Raise ScheduleError if incomplete, misplaced or deadlocking; return self otherwise."""
        from pipeloom.ir.validate import validate

        validate(self)
        return self

    def grid(self, marks: Iterable[tuple[int, int]] = ()) -> str:
        """The device×step grid, marking (device, step) cells."""
        from pipeloom.ir.text import render_grid

        return render_grid(self, marks)

    def __str__(self) -> str:
        return self.grid()
