"""Split every fused backward BW into B (input gradient) and W (weight gradient).

Only B sits on the critical path between stages; W depends on nothing but its own B, so it can
go wherever it costs least (Zero Bubble §2, 2BP §3). Where it goes is the policy:

* ``after``    — right after its B: the same order as BW, only the dependency is shorter;
* ``deferred`` — every W at the end of its device's step (2BP's GPipe). With ``batch=True`` the
  deferred W of each stage are contiguous, and the runtime may run such a run as one GEMM over
  the concatenated micro-batches (2BP Fig. 2); the IR keeps one W per micro-batch so that
  validation, memory and timing stay per micro-batch;
* ``fill``     — into the idle gaps of the ``deferred`` timeline under `costs` (default F=1, B=2,
  W=1) that hold it wholly, the rest at the end (2BP's 1F1B). A W that fits its gap cannot delay
  anything, so every other op keeps its time and the step only gets shorter.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["fold_lone_w", "fold_w_at_once", "lone_w_keys", "split_backward", "w_at_once_keys", "W_PLACEMENTS"]

W_PLACEMENTS = ("after", "deferred", "fill")
_EPS = 1e-9


def split_backward(
    schedule: Schedule, placement: str = "after", *, costs: Costs | None = None, batch: bool = False
) -> Schedule:
    """Return `schedule` with each BW replaced by B and a W placed by `placement`.

    >>> from pipeloom.schedules import build_schedule
    >>> s = split_backward(build_schedule("1f1b", 2, 2), "deferred")
    >>> s.to_text().splitlines()[1:]
    ['0F0 0F1 0B0 0B1 0W0 0W1', '1F0 1B0 1F1 1B1 1W0 1W1']
    """
    if placement not in W_PLACEMENTS:
        raise ConfigError(f"split_backward: unknown W placement {placement!r}; choose one of {', '.join(W_PLACEMENTS)}")
    if batch and placement == "after":
        raise ConfigError("split_backward: batch=True groups deferred W ops; use placement 'deferred' or 'fill'")
    if placement == "after":
        devices = [_split_after(ops) for ops in schedule.devices]
        return schedule.with_devices(devices, name=_name(schedule, placement, batch))
    deferred = schedule.with_devices(
        [_split_deferred(ops, batch) for ops in schedule.devices], name=_name(schedule, placement, batch)
    )
    if placement == "deferred":
        return deferred
    return _fill_gaps(deferred, costs if costs is not None else Costs(W=1.0), batch)


def fold_w_at_once(schedule: Schedule) -> Schedule:
    """`schedule` as the runtime runs it: each B whose W it runs inside it (`w_at_once_keys`)
    becomes a BW, one autograd pass, its W gone. A plan that says so is priced as it runs — a
    fused backward's time (`Costs.BW`), no weight gradient held pending between its B and W.

    >>> from pipeloom.schedules import build_schedule
    >>> fold_w_at_once(split_backward(build_schedule("1f1b", 2, 2), "after")).to_text().splitlines()[1:]
    ['0F0 0F1 0BW0 0BW1', '1F0 1BW0 1F1 1BW1']
    """
    alone = schedule.num_devices == 1
    devices = []
    for ops in schedule.devices:
        fused = w_at_once_keys(ops, alone) - {op.key for op in ops if op.kind is OpKind.BW}
        devices.append(
            [
                Op(OpKind.BW, op.stage, op.microbatch, op.slice, overlap_next=op.overlap_next)
                if op.kind is OpKind.B and op.key in fused
                else op
                for op in ops
                if not (op.kind is OpKind.W and op.key in fused)
            ]
        )
    return schedule if devices == [list(ops) for ops in schedule.devices] else schedule.with_devices(devices)


def fold_lone_w(schedule: Schedule) -> Schedule:
    """`fold_w_at_once` where one device holds the whole pipeline: nothing waits for a B's result
    there, so a W fills no gap, and each whole W folds into its B (a W in parts stays).

    >>> from pipeloom.schedules import build_schedule
    >>> fold_lone_w(split_backward(build_schedule("1f1b", 1, 2), "deferred")).to_text().splitlines()[1]
    '0F0 0BW0 0F1 0BW1'
    """
    return fold_w_at_once(schedule) if schedule.num_devices == 1 else schedule


def w_at_once_keys(ops: Sequence[Op], alone: bool) -> set[tuple[int, int, int]]:
    """The keys of a device's backwards that the runtime runs as one autograd pass, the weight
    gradients inside B (its linears then ordinary: nothing to queue): each BW; each B whose own
    whole W is the very next op (nothing runs between them to fill); and on a device `alone` in
    its pipeline, where no other device waits for a B's result, every B whose W is whole."""
    keys = {op.key for op in ops if op.kind is OpKind.BW}
    if alone:
        return keys | lone_w_keys(ops)
    for op, following in zip(ops, ops[1:]):
        if op.kind is OpKind.B and following.kind is OpKind.W and following.key == op.key and following.parts == 1:
            keys.add(op.key)
    return keys


def lone_w_keys(ops: Sequence[Op]) -> set[tuple[int, int, int]]:
    """The keys of the W a device alone in its pipeline runs inside their B: the whole ones."""
    return {op.key for op in ops if op.kind is OpKind.W and op.parts == 1}


def _name(schedule: Schedule, placement: str, batch: bool) -> str:
    return f"{schedule.name}+split-{placement}{'-batched' if batch else ''}"


def _as_b(op: Op) -> Op:
    """The BW's B, still the head of its overlapped pair if the BW was (backward first)."""
    return Op(OpKind.B, op.stage, op.microbatch, op.slice, overlap_next=op.overlap_next)


def _as_w(op: Op) -> Op:
    return Op(OpKind.W, op.stage, op.microbatch, op.slice)


def _split_after(ops: tuple[Op, ...]) -> list[Op]:
    """Each W right after its B — or, when the B heads an overlapped pair, after the pair."""
    out: list[Op] = []
    after_pair: Op | None = None
    for op in ops:
        out.append(_as_b(op) if op.kind is OpKind.BW else op)
        if after_pair is not None:
            out.append(after_pair)
            after_pair = None
        if op.kind is OpKind.BW:
            if op.overlap_next:
                after_pair = _as_w(op)
            else:
                out.append(_as_w(op))
    return out


def _split_deferred(ops: tuple[Op, ...], batch: bool) -> list[Op]:
    head = [_as_b(op) if op.kind is OpKind.BW else op for op in ops]
    tail = [_as_w(op) for op in ops if op.kind is OpKind.BW]
    return head + (_grouped_by_stage(tail) if batch else tail)


def _grouped_by_stage(ops: list[Op]) -> list[Op]:
    """Stable: stages in order of first appearance, each stage's ops in their order."""
    first_seen: dict[int, int] = {}
    for index, op in enumerate(ops):
        first_seen.setdefault(op.stage, index)
    return sorted(ops, key=lambda op: first_seen[op.stage])


def _fill_gaps(deferred: Schedule, costs: Costs, batch: bool) -> Schedule:
    """Move each device's trailing W ops into the gaps of its timeline that hold them wholly."""
    from pipeloom.sim.simulate import simulate  # the pass is a client of the simulator

    timeline = simulate(deferred, costs)
    table = costs.resolve(deferred.num_devices, deferred.num_stages, deferred.num_slices)
    devices = []
    for d, ops in enumerate(deferred.devices):
        num_tail = 0
        while num_tail < len(ops) and ops[len(ops) - 1 - num_tail].kind is OpKind.W:
            num_tail += 1
        body, tail = ops[: len(ops) - num_tail], ops[len(ops) - num_tail :]
        waiting = {op.key: op for op in tail}  # W ops whose B has not run yet
        ready: deque[Op] = deque()
        out: list[Op] = []
        clock = None
        for step, op in enumerate(body):
            start, end = timeline.interval(d, step)
            if clock is not None and not body[step - 1].overlap_next:  # nothing between a pair's ops
                clock = _place_into_gap(out, ready, clock, start, table)
            out.append(op)
            clock = end
            if op.kind is OpKind.B and op.key in waiting:
                ready.append(waiting.pop(op.key))
        leftover = [*ready, *waiting.values()]
        out.extend(_grouped_by_stage(leftover) if batch else leftover)
        devices.append(out)
    return deferred.with_devices(devices)


def _place_into_gap(out: list[Op], ready: deque[Op], clock: float, gap_end: float, table) -> float:
    """Append ready W ops that finish by `gap_end`; return the new clock."""
    while ready:
        op = ready[0]
        duration = table.time_of(OpKind.W, table.index(op))
        if clock + duration > gap_end + _EPS:
            break
        out.append(ready.popleft())
        clock += duration
    return clock
