"""The dependency graph of a schedule: what each op waits for (docs/design.md §1), checked as it is built.

Ops are numbered device by device (so a device's ops are one contiguous range) and keyed by
(stage, micro-batch, slice) packed into one integer, which keeps construction and the simulator's
inner loop to list indexing. Building the graph is where completeness and co-location are checked;
the absence of cycles is checked by walking it (`pipeloom.ir.walk`, which the simulator times with).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pipeloom.errors import ScheduleError
from pipeloom.ir.ops import OVERLAPPABLE, Op, OpKind

if TYPE_CHECKING:  # only named in annotations: the IR's modules build on Schedule, not back
    from pipeloom.ir.schedule import Schedule

__all__ = ["DependencyGraph", "build_graph"]

_MAX_REPORTED = 8
_F, _R, _B, _W, _BW = OpKind.F, OpKind.R, OpKind.B, OpKind.W, OpKind.BW


@dataclass(frozen=True, slots=True)
class DependencyGraph:
    """Flat view of a valid-so-far schedule.

    `deps[g]` lists the ops op g needs (data dependencies only; device order is implied by
    `offsets`). `waits[g]` is what op g waits for before it starts: its deps, except that the
    head of an overlapped pair (`Op.overlap_next`) waits for both ops' deps and its partner, which
    starts with it, for nothing. `paired` holds the pairs' heads.
    """

    schedule: Schedule
    ops: list[Op]
    device_of: list[int]
    offsets: list[int]  # ops of device d are flat indices offsets[d] .. offsets[d+1]-1
    deps: list[tuple[int, ...]]
    waits: list[tuple[int, ...]]
    paired: frozenset[int]

    @property
    def num_ops(self) -> int:
        return len(self.ops)

    def locate(self, g: int) -> tuple[int, int]:
        """(device, step) of flat op g."""
        device = self.device_of[g]
        return device, g - self.offsets[device]

    def describe(self, g: int) -> str:
        device, step = self.locate(g)
        return f"{self.ops[g].text} (device {device}, step {step})"


def build_graph(schedule: Schedule) -> DependencyGraph:
    """Index the schedule and resolve every dependency; raise ScheduleError naming bad ops.

    The graph is kept on the schedule (which never changes), so every later simulation of it,
    under whatever costs, skips the indexing."""
    graph = schedule._graph
    if not isinstance(graph, DependencyGraph):
        graph = _index(schedule)
        object.__setattr__(schedule, "_graph", graph)
    return graph


def _index(schedule: Schedule) -> DependencyGraph:
    num_stages, num_mb, num_slices = schedule.num_stages, schedule.num_microbatches, schedule.num_slices
    num_keys = num_stages * num_mb * num_slices
    stage_stride = num_mb * num_slices
    f_at = [-1] * num_keys
    r_at = [-1] * num_keys
    b_at = [-1] * num_keys  # the B or BW of a key
    w_at: dict[int, list[int]] = {}
    ops: list[Op] = []
    device_of: list[int] = []
    offsets = [0]
    problems: list[tuple[str, tuple[int, ...]]] = []
    pair_heads: list[int] = []

    # Pass 1: number the ops and register who produces what. (The op loops below are the
    # tuner's hottest Python: kinds and methods are bound to locals, each op's key computed once.)
    op_w, op_f, op_r, op_b, op_bw = _W, _F, _R, _B, _BW
    keys: list[int] = []
    add_op, add_device, add_key = ops.append, device_of.append, keys.append
    for device, device_ops in enumerate(schedule.devices):
        for op in device_ops:
            g = len(ops)
            add_op(op)
            add_device(device)
            if op.overlap_next:
                pair_heads.append(g)
            stage, microbatch, slice_ = op.stage, op.microbatch, op.slice
            if not (0 <= stage < num_stages and 0 <= microbatch < num_mb and 0 <= slice_ < num_slices):
                problems.append((_out_of_range(op, schedule), (g,)))
                add_key(-1)
                continue
            key = (stage * num_mb + microbatch) * num_slices + slice_
            add_key(key)
            kind = op.kind
            if kind is op_w:
                w_at.setdefault(key, []).append(g)
                continue
            if kind is op_f:
                table = f_at
            elif kind is op_r:
                table = r_at
            elif kind is op_b or kind is op_bw:
                table = b_at
            else:  # the kinds are aliased for speed, which mypy cannot narrow: assert_never would not type
                raise AssertionError(f"unknown op kind {kind!r}")
            if table[key] >= 0:
                problems.append((f"duplicated {_role(kind)} of key {_key_text(op)}", (table[key], g)))
            else:
                table[key] = g
        offsets.append(len(ops))

    # Pass 2: completeness and co-location, key by key.
    for key in range(num_keys):
        f = f_at[key]
        b = b_at[key]
        if f < 0:
            problems.append(
                (f"missing forward {_forward_of_key(key, num_mb, num_slices).text}", _present(r_at[key], b))
            )
            continue
        forward = ops[f]
        home = device_of[f]
        r = r_at[key]
        if forward.ckpt and r < 0:
            problems.append((f"missing R for checkpointed {forward.text}", (f,)))
        if not forward.ckpt and r >= 0:
            problems.append((f"{ops[r].text} recomputes {forward.text}, which is not checkpointed", (f, r)))
        if schedule.forward_only:
            extra = [g for g in (r, b, *w_at.get(key, ())) if g >= 0] + ([f] if forward.ckpt else [])
            if extra:
                problems.append((f"a forward-only schedule holds {ops[extra[0]].text}: forwards (F) only", (extra[0],)))
            continue
        if b < 0:
            problems.append((f"missing backward (B or BW) for {forward.text}", (f,)))
        elif ops[b].kind is _BW and key in w_at:
            problems.append((f"{ops[b].text} is a fused backward but W ops also exist for its key", (b, *w_at[key])))
        elif ops[b].kind is _B:
            _check_parts(ops, ops[b], b, w_at.get(key, []), problems)
        for other in (r, b, *w_at.get(key, ())):
            if other >= 0 and device_of[other] != home:
                problems.append(
                    (
                        f"{ops[other].text} runs on device {device_of[other]} but {forward.text} ran on device {home}",
                        (f, other),
                    )
                )
    if problems:
        _raise_problems(schedule, offsets, device_of, problems)

    # Pass 3: data dependencies (docs/design.md §1 table).
    deps: list[tuple[int, ...]] = []
    add_deps = deps.append
    last_stage, last_slice = num_stages - 1, num_slices - 1
    for op, key in zip(ops, keys):
        kind = op.kind
        if kind is op_f:
            if op.stage:
                add_deps((f_at[key - stage_stride], f_at[key - 1]) if op.slice else (f_at[key - stage_stride],))
            else:
                add_deps((f_at[key - 1],) if op.slice else ())
        elif kind is op_w:
            add_deps((b_at[key],))
        elif kind is op_r or kind is op_b or kind is op_bw:  # and the gradient inputs, for B/BW and an R inside it
            need = [f_at[key] if kind is op_r or not ops[f_at[key]].ckpt else r_at[key]]
            if kind is not op_r or op.after_grad:
                if op.stage != last_stage:
                    need.append(b_at[key + stage_stride])
                if op.slice != last_slice:
                    need.append(b_at[key + 1])
            add_deps(tuple(need))
        else:
            raise AssertionError(f"unknown op kind {kind!r}")
    paired = frozenset(pair_heads)
    if not paired:
        return DependencyGraph(schedule, ops, device_of, offsets, deps, deps, paired)
    _check_pairs(schedule, ops, device_of, offsets, deps, paired)
    waits = list(deps)
    for g in paired:
        waits[g], waits[g + 1] = deps[g] + deps[g + 1], ()
    return DependencyGraph(schedule, ops, device_of, offsets, deps, waits, paired)


def _check_pairs(
    schedule: Schedule,
    ops: list[Op],
    device_of: list[int],
    offsets: list[int],
    deps: list[tuple[int, ...]],
    paired: frozenset[int],
) -> None:
    """An overlapped pair is a forward and a backward, next to each other, neither needing the other."""
    problems: list[tuple[str, tuple[int, ...]]] = []
    for g in sorted(paired):
        head = ops[g]
        if g + 1 == offsets[device_of[g] + 1]:
            problems.append((f"{head.text} overlaps the next op but is its device's last", (g,)))
            continue
        tail = ops[g + 1]
        if tail.overlap_next:
            problems.append((f"{head.text}{tail.text}: a pair is two ops, not a chain of three", (g, g + 1)))
        elif not {head.kind, tail.kind} <= OVERLAPPABLE or (head.kind is _F) == (tail.kind is _F):
            problems.append(
                (f"{head.text}{tail.text}: a pair is one forward (F) and one backward (B or BW)", (g, g + 1))
            )
        elif g in deps[g + 1] or g + 1 in deps[g]:
            problems.append(
                (f"{head.text}{tail.text}: one needs the other's output, so they cannot overlap", (g, g + 1))
            )
    if problems:
        _raise_problems(schedule, offsets, device_of, problems)


def _raise_problems(
    schedule: Schedule,
    offsets: list[int],
    device_of: list[int],
    problems: list[tuple[str, tuple[int, ...]]],
) -> None:
    """Raise one ScheduleError listing `problems` (text, flat op indices) over the marked grid."""
    marks = {(device_of[g], g - offsets[device_of[g]]) for _, flat in problems[:_MAX_REPORTED] for g in flat}
    more = len(problems) - 1
    summary = f"invalid schedule {schedule.name!r}: {problems[0][0]}" + (f" (and {more} more)" if more else "")
    lines = [f"- {text}" for text, _ in problems[:_MAX_REPORTED]]
    if len(problems) > _MAX_REPORTED:
        lines.append(f"- ... {len(problems) - _MAX_REPORTED} more")
    raise ScheduleError(summary, "\n".join(lines) + "\n" + schedule.grid(marks))


def _check_parts(ops: list[Op], backward: Op, b: int, ws: list[int], problems: list) -> None:
    if not ws:
        problems.append((f"missing W for {backward.text}", (b,)))
        return
    if len(ws) == 1 and ops[ws[0]].parts == 1 and ops[ws[0]].part == 0:  # the common case: one whole W
        return
    parts = ops[ws[0]].parts
    if any(ops[w].parts != parts for w in ws):
        problems.append((f"W ops of key {_key_text(backward)} disagree on their number of parts", tuple(ws)))
        return
    seen: dict[int, int] = {}
    for w in ws:
        part = ops[w].part
        if part in seen:
            problems.append((f"duplicated W part {part}/{parts} of key {_key_text(backward)}", (seen[part], w)))
        seen[part] = w
    missing = [part for part in range(parts) if part not in seen]
    if missing:
        problems.append((f"missing W part(s) {missing} of {parts} for {backward.text}", tuple(ws)))


def _role(kind: OpKind) -> str:
    return "backward (B/BW)" if kind in (_B, _BW) else kind.value


def _key_text(op: Op) -> str:
    return f"(stage {op.stage}, mb {op.microbatch}" + (f", slice {op.slice})" if op.slice else ")")


def _forward_of_key(key: int, num_mb: int, num_slices: int) -> Op:
    rest, slice_ = divmod(key, num_slices)
    stage, microbatch = divmod(rest, num_mb)
    return Op(_F, stage, microbatch, slice_)


def _present(*flat: int) -> tuple[int, ...]:
    return tuple(g for g in flat if g >= 0)


def _out_of_range(op: Op, schedule: Schedule) -> str:
    return (
        f"{op.text} is out of range: the schedule has {schedule.num_stages} stages, "
        f"{schedule.num_microbatches} micro-batches, {schedule.num_slices} slices"
    )
