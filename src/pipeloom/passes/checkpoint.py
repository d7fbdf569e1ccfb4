"""Activation checkpointing tessellated into pipeline bubbles: Mario's four graph passes (§5.1).

A checkpointed forward keeps only its input (M_ckpt); its recompute R restores the activations
(M_B) before the backward. Each pass is a pure function from a valid schedule to a valid one:

* `apply_checkpoint` — checkpoint forwards and put each R right before its backward, *inside* it:
  the R waits for the backward's input gradient (``after_grad``), as torch.utils.checkpoint does.
  This is Mario's step 1, the expensive baseline (Figure 2: 21 → 28);
* `overlap_recompute` — let every R run as soon as its device is free, before its backward's
  gradient arrives (step 2); optionally also move an R that still delays its backward into an
  earlier idle gap (after its forward) that holds it wholly, so nothing else is delayed;
* `remove_redundancy` — undo checkpointing where R directly follows its forward: it saves no
  memory and costs a recompute (step 3);
* `prepose_forward` — move checkpointed forwards into earlier idle gaps that hold them wholly and
  that their input has reached. A checkpointed forward costs only its input's memory, so running
  it early is cheap, and its old slot becomes room for recomputes (step 4).

Gaps come from the simulator's timeline under the given costs; an op moved into a gap that holds
it wholly cannot delay anything placed before it, so these moves never lengthen the step.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace

from pipeloom.budget import per_device
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["apply_checkpoint", "overlap_recompute", "remove_redundancy", "relax_checkpoint", "prepose_forward"]

_F, _R, _B, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.BW
_EPS = 1e-9


def apply_checkpoint(
    schedule: Schedule, *, devices: Collection[int] | None = None, stages: Collection[int] | None = None
) -> Schedule:
    """Checkpoint every forward (of the given devices / stages) with its R inside its backward.

    >>> from pipeloom.schedules import build_schedule
    >>> apply_checkpoint(build_schedule("1f1b", 2, 1)).to_text().splitlines()[1:]
    ['0F0c 0R0g 0BW0', '1F0c 1R0g 1BW0']
    """
    devices_out: list[list[Op] | tuple[Op, ...]] = []
    for d, ops in enumerate(schedule.devices):
        if devices is not None and d not in devices:
            devices_out.append(ops)
            continue
        chosen = {op.key for op in ops if op.kind is _F and not op.ckpt and (stages is None or op.stage in stages)}
        out: list[Op] = []
        for op in ops:
            if op.kind is _F and op.key in chosen:
                out.append(replace(op, ckpt=True))
            elif op.kind in (_B, _BW) and op.key in chosen:
                recompute = Op(_R, op.stage, op.microbatch, op.slice, after_grad=True)
                if out and out[-1].overlap_next:  # the backward of an overlapped pair: R before the pair
                    out.insert(len(out) - 1, recompute)
                    out.append(op)
                else:
                    out += (recompute, op)
            else:
                out.append(op)
        devices_out.append(out)
    return schedule.with_devices(devices_out, name=_tagged(schedule.name, "ckpt"))


def overlap_recompute(schedule: Schedule, costs: Costs | None = None, *, into_gaps: bool = False) -> Schedule:
    """Every R runs as soon as its device is free, before its backward's gradient arrives
    (Mario's pass 2). With `into_gaps` (needs `costs`), an R that still delays its backward also
    moves into an earlier idle gap, after its forward, that holds it wholly — the latest such gap,
    so the restored activations live the shortest time.

    >>> s = Schedule.from_text("0F0c 0R0g 0BW0")
    >>> overlap_recompute(s).to_text().splitlines()[1:]
    ['0F0c 0R0 0BW0']
    """
    refuse_pairs(schedule, "overlap-recompute")
    freed = schedule.with_devices(
        [[replace(op, after_grad=False) if op.kind is _R else op for op in ops] for ops in schedule.devices],
        name=_tagged(schedule.name, "overlap"),
    )
    if not into_gaps:
        return freed
    if costs is None:
        raise ConfigError("overlap_recompute: into_gaps needs the costs that define the gaps")
    timeline = _simulate(freed, costs)
    durations = _durations(freed, costs)
    devices = []
    for d, ops in enumerate(freed.devices):
        times = [timeline.interval(d, step) for step in range(len(ops))]
        gaps = _gaps(times)
        moves: dict[int, int] = {}  # step of an R -> step it moves before
        forward_step = {op.key: step for step, op in enumerate(ops) if op.kind is _F}
        for step, op in enumerate(ops):
            if op.kind is not _R or step + 1 >= len(ops):
                continue
            backward = ops[step + 1]
            if backward.key != op.key or times[step + 1][0] > times[step][1] + _EPS:
                continue  # not right before its backward, or the backward waits for something else anyway
            after_forward = forward_step[op.key] + 1  # an R is always on its forward's device
            for gap in reversed(gaps):
                at, room_start, room_end = gap
                if at < after_forward or at > step:
                    continue
                if room_end - room_start >= durations[op] - _EPS:
                    moves[step] = at
                    gap[1] = room_start + durations[op]
                    break
        devices.append(_reorder(ops, moves))
    return freed.with_devices(devices)


def remove_redundancy(schedule: Schedule) -> Schedule:
    """Un-checkpoint forwards whose R comes right after them.

    >>> s = Schedule.from_text("0F0c 0R0 0BW0")
    >>> remove_redundancy(s).to_text().splitlines()[1:]
    ['0F0 0BW0']
    """
    devices = []
    for ops in schedule.devices:
        redundant = {
            op.key
            for op, after in zip(ops, ops[1:])
            if op.kind is _F and op.ckpt and after.kind is _R and after.key == op.key
        }
        devices.append(
            [
                replace(op, ckpt=False) if op.kind is _F and op.key in redundant else op
                for op in ops
                if not (op.kind is _R and op.key in redundant)
            ]
        )
    return schedule.with_devices(devices, name=_tagged(schedule.name, "dedup"))


def relax_checkpoint(schedule: Schedule, costs: Costs, mem_limit: float | Sequence[float] | None = None) -> Schedule:
    """Un-checkpoint forwards wherever the device's activation memory stays within `mem_limit`
    (default: its current peak, i.e. where checkpointing saves nothing).

    The generalisation of `remove_redundancy` (ours), and what makes checkpointing selective: a
    device keeps the activations of as many forwards as its budget holds. Forwards are tried in
    order.
    """
    table = costs.resolve(schedule.num_devices, schedule.num_stages, schedule.num_slices)
    budgets = _per_device(mem_limit, schedule.num_devices)
    timeline = _simulate(schedule, costs)  # for its per-op memory changes
    devices = []
    for d, ops in enumerate(schedule.devices):
        level, levels = 0.0, []
        first = timeline.graph.offsets[d]
        for g in range(first, first + len(ops)):
            level += timeline.memory_delta[g]
            levels.append(level)
        peak = max(levels, default=0.0) if budgets is None else budgets[d]
        forward_step = {op.key: step for step, op in enumerate(ops) if op.kind is _F and op.ckpt}
        relaxed = set()
        for step, op in enumerate(ops):
            if op.kind is not _R or op.key not in forward_step:
                continue
            first = forward_step[op.key]
            extra = table.memory_delta(op)  # what the R restores, held from the F on if not dropped
            if max(levels[first:step], default=0.0) + extra <= peak + _EPS:
                relaxed.add(op.key)
                for held in range(first, step):
                    levels[held] += extra
        devices.append(
            [
                replace(op, ckpt=False) if op.kind is _F and op.key in relaxed else op
                for op in ops
                if not (op.kind is _R and op.key in relaxed)
            ]
        )
    return schedule.with_devices(devices, name=_tagged(schedule.name, "relax"))


def prepose_forward(schedule: Schedule, costs: Costs) -> Schedule:
    """Move checkpointed forwards into the earliest earlier gap that holds them and that their
    input has reached, keeping each stage's forwards in micro-batch order."""
    refuse_pairs(schedule, "prepose-forward")
    timeline = _simulate(schedule, costs)
    durations = _durations(schedule, costs)
    arrival = _input_arrivals(schedule, timeline, costs)
    devices = []
    for d, ops in enumerate(schedule.devices):
        times = [timeline.interval(d, step) for step in range(len(ops))]
        gaps = _gaps(times)
        moves: dict[int, int] = {}
        last_forward_step: dict[int, int] = {}  # stage -> step of its previous forward here
        for step, op in enumerate(ops):
            if op.kind is not _F:
                continue
            previous = last_forward_step.get(op.stage, -1)
            last_forward_step[op.stage] = step
            if not op.ckpt:
                continue
            for gap in gaps:
                at, room_start, room_end = gap
                if at >= step or at <= previous:
                    continue
                begin = max(room_start, arrival[(d, step)])
                if room_end - begin >= durations[op] - _EPS:
                    moves[step] = at
                    gap[1] = begin + durations[op]
                    break
        devices.append(_reorder(ops, moves))
    return schedule.with_devices(devices, name=_tagged(schedule.name, "prepose"))


# -- helpers -------------------------------------------------------------------------------


def refuse_pairs(schedule: Schedule, what: str) -> None:
    """Passes that move ops one at a time would split an overlapped F&B pair."""
    pair = next((op for _, _, op in schedule.ops() if op.overlap_next), None)
    if pair is not None:
        raise ConfigError(
            f"{what} moves ops one by one and would split the overlapped pairs of {schedule.name!r} (e.g. {pair.text}); "
            "plain checkpointing (apply-checkpoint) keeps them"
        )


def _per_device(limit: float | Sequence[float] | None, num_devices: int) -> list[float] | None:
    if limit is None:
        return None
    return per_device(limit, num_devices, "checkpoint")


def _tagged(name: str, tag: str) -> str:
    return name if name.endswith(f"+{tag}") else f"{name}+{tag}"


def _simulate(schedule: Schedule, costs: Costs):
    from pipeloom.sim.simulate import simulate  # passes are clients of the simulator

    return simulate(schedule, costs)


def _durations(schedule: Schedule, costs: Costs) -> dict[Op, float]:
    table = costs.resolve(schedule.num_devices, schedule.num_stages, schedule.num_slices)
    return {op: table.duration(op) for _, _, op in schedule.ops() if op.kind in (_F, _R)}


def _gaps(times: list[tuple[float, float]]) -> list[list]:
    """Idle intervals of a device as [step of the op after the gap, gap start, gap end]."""
    return [
        [step, times[step - 1][1], times[step][0]]
        for step in range(1, len(times))
        if times[step][0] > times[step - 1][1] + _EPS
    ]


def _reorder(ops: tuple[Op, ...], moves: dict[int, int]) -> list[Op]:
    """Move ops[step] to just before ops[target] for each step -> target (target < step)."""
    before: dict[int, list[Op]] = {}
    for step in sorted(moves):
        before.setdefault(moves[step], []).append(ops[step])
    out: list[Op] = []
    for step, op in enumerate(ops):
        out.extend(before.get(step, ()))
        if step not in moves:
            out.append(op)
    return out


def _input_arrivals(schedule: Schedule, timeline, costs: Costs) -> dict[tuple[int, int], float]:
    """(device, step) of each forward -> when its input is available (the previous stage's F
    end, plus comm across devices, and the previous slice's F on the same stage)."""
    where: dict[tuple[int, int, int], tuple[int, float]] = {}
    for t in timeline.timings():
        if t.op.kind is _F:
            where[t.op.key] = (t.device, t.end)
    out = {}
    for t in timeline.timings():
        op = t.op
        if op.kind is not _F:
            continue
        ready = 0.0
        for key in ((op.stage - 1, op.microbatch, op.slice), (op.stage, op.microbatch, op.slice - 1)):
            if key in where and key[0] >= 0 and key[2] >= 0:
                device, end = where[key]
                ready = max(ready, end + (costs.comm if device != t.device else 0.0))
        out[(t.device, t.step)] = ready
    return out
