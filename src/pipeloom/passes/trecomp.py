"""T-Recomp (TPipe §4.2, appendices B and C): recompute only the shallow chunks, block-wise.

A device's shallow chunk keeps its activations longest (its backward comes last), so dropping
exactly those saves the most memory per recompute. The recompute of a chunk is one R op of its
own, decoupled from the backward: it runs as soon as its device reaches it and never waits for a
gradient, so recompute time never accumulates along the pipeline and never shifts a dependency
between stages.

* On T-Pipe the pass rebuilds the periodic template with a recompute slot per recomputed chunk
  (cycle ``F R B F B``: 7 units instead of 6). The recompute slots make the forwards reach their
  slots later, so a deep chunk's forward may have to wait whole cycles for its input; the rounds
  it waits beyond T-Pipe's (`chunk_delay_rounds`) are the delay of appendix B, found by the
  construction rather than assumed.
* On any other schedule whose stage s runs on device s mod p (interleaved 1F1B, Fig. 6(e)), the
  pass checkpoints the chosen chunks' forwards and puts each R right before its backward.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.tpipe import schedule_from_template, slot_template, tpipe

__all__ = ["t_recomp", "chunk_delay_rounds"]

_F, _R, _B, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.BW


def t_recomp(schedule: Schedule, chunks: Collection[int] | None = None) -> Schedule:
    """Recompute `chunks` (default: the shallowest, chunk 0) of every device, block-wise.

    >>> from pipeloom.schedules import build_schedule
    >>> print(t_recomp(build_schedule("interleaved", 2, 1)).to_text().splitlines()[1])
    0F0c 2F0 2BW0 0R0 0BW0
    """
    p, num_chunks = _looping_shape(schedule)
    chosen = _chosen_chunks(chunks, num_chunks)
    m = schedule.num_microbatches
    if schedule.devices == tpipe(p, m, num_chunks).devices:
        return schedule_from_template(slot_template(p, num_chunks, chosen), m, f"{schedule.name}+trecomp")
    stages = {stage for chunk in chosen for stage in range(chunk * p, (chunk + 1) * p)}
    devices = []
    for ops in schedule.devices:
        out: list[Op] = []
        for op in ops:
            if op.stage in stages and op.kind is _F:
                out.append(replace(op, ckpt=True))
                continue
            if op.stage in stages and op.kind in (_B, _BW):
                out.append(Op(_R, op.stage, op.microbatch, op.slice))
            out.append(op)
        devices.append(out)
    return schedule.with_devices(devices, name=f"{schedule.name}+trecomp")


def chunk_delay_rounds(num_devices: int, num_chunks: int = 2, chunks: Collection[int] = (0,)) -> list[int]:
    """For each chunk after the first: how many more cycles T-Pipe + T-Recomp waits before the
    chunk's first forward than T-Pipe does (appendix B's k for two chunks)."""
    plain = slot_template(num_devices, num_chunks)
    recomputing = slot_template(num_devices, num_chunks, _chosen_chunks(chunks, num_chunks))
    return [
        recomputing.round_of(chunk * num_devices) - plain.round_of(chunk * num_devices)
        for chunk in range(1, num_chunks)
    ]


def _looping_shape(schedule: Schedule) -> tuple[int, int]:
    """(p, v) of a schedule whose stage s runs on device s mod p with v >= 2, else ConfigError."""
    p, num_stages = schedule.num_devices, schedule.num_stages
    if num_stages % p or num_stages // p < 2:
        raise ConfigError(
            f"t_recomp needs at least 2 chunks per device (stage s on device s mod p), "
            f"but {schedule.name!r} has {num_stages} stages on {p} devices"
        )
    for device, ops in enumerate(schedule.devices):
        for op in ops:
            if op.stage % p != device:
                raise ConfigError(
                    f"t_recomp needs stage s on device s mod p, but {schedule.name!r} runs {op.text} on device {device}"
                )
            if op.ckpt or op.kind is _R:
                raise ConfigError(f"t_recomp: {schedule.name!r} is already checkpointed ({op.text})")
    return p, num_stages // p


def _chosen_chunks(chunks: Collection[int] | None, num_chunks: int) -> frozenset[int]:
    chosen = frozenset((0,) if chunks is None else chunks)
    bad = sorted(chunk for chunk in chosen if not isinstance(chunk, int) or not 0 <= chunk < num_chunks)
    if bad or not chosen:
        raise ConfigError(f"t_recomp: chunks must be among 0..{num_chunks - 1} (0 = shallowest), got {sorted(chosen)}")
    return chosen
