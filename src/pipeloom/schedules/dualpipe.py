"""DualPipe and DualPipeV (DeepSeek-V3 report, §3.2.1; deepseek-ai/DualPipe).

Each device runs two chunks, *phase 0* and *phase 1*, through eight steps whose lengths depend
only on the device's rank r in a pipeline of H ranks and on C, the micro-batches each chunk sees:

    1. F0 × 2(H−r−1)          warm-up of the chunk nearer its pipeline's start
    2. (F0 F1) × (r+1)
    3. (B1 W1 F1) × (H−r−1)   zero-bubble: the weight gradient fills the slot at once
    4. (F0&B1 F1&B0) × (C−2H+r+1)   the steady state: overlapped forward-backward pairs
    5. (B1 F1&B0) × (H−r−1)
    6. (B1 B0) × (r+1)        from the middle on, backwards leave their W for later
    7. (W B0) × (H−r−1)
    8. W × (r+1)

(Fp&Bq: forward of phase p and backward of phase q as one overlapped pair; the first pair of the
steady state is split on the middle rank, where nothing waits for it.) W are taken first in,
first out.

* ``dualpipe``: p devices (even), two pipelines in opposite directions as in Chimera: the first
  m/2 micro-batches go down (stage s on device s), the others up (stage s on device p−1−s), so
  each device holds two stages (2× parameters). Phase 0 is the direction in which the device is
  in the first half (down on devices < p/2); H = p/2, C = m/2.
* ``dualpipev``: the same steps with one copy of the model, cut in half into a V (device d holds
  stages d and 2p−1−d, like ZB-V); phase 0 is stage d; H = p, C = m.

Bubbles (DeepSeek-V3 Table 2, PP stages): 1F1B (PP−1)(F+B), ZB1P (PP−1)(F+B−2W), DualPipe
(PP/2−1)(F&B+B−3W) with PP+1 micro-batches of activations per device.

Given `costs`, a pair whose overlap hides nothing (its time is its two ops' lone times, as when
no a2a is priced) is split into its two ops: a pair only adds a constraint — its forward waits
for its backward's input — so the split order is never slower, and the memory order is the same.
Without costs the reference's pairs are kept (torch's ScheduleDualPipeV order, op for op).
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.registry import Tuning, register

__all__ = ["dualpipe", "dualpipev", "dual_steps"]

_F, _B, _BW, _W = OpKind.F, OpKind.B, OpKind.BW, OpKind.W


def _two_p_minus_2(pp: int) -> int:
    """DualPipe's steady state needs 2p-2 micro-batches (p-1 per direction)."""
    return 2 * pp - 2


def _two_p_minus_1(pp: int) -> int:
    """DualPipeV's steps need 2p-1 micro-batches."""
    return 2 * pp - 1


@register(
    "dualpipe",
    family="dualpipe",
    paper="DeepSeek-AI 2024, DeepSeek-V3 Technical Report (DualPipe)",
    summary="two pipelines in opposite directions with forward-backward pairs overlapped, so "
    "communication inside F and B (MoE all-to-all) hides; 2× parameters, p+1 activations",
    domain="p even >= 2, m even >= 2p - 2; costs (split the pairs that hide nothing)",
    options=("costs",),
    tuning=Tuning(
        "dualpipe", layout="mirrored", even=True, min_devices=2, fallbacks=(), fewest_microbatches=_two_p_minus_2
    ),
    pareto="fixed",
)
def dualpipe(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """DualPipe on p devices: micro-batches 0..m/2−1 go down, m/2..m−1 go up.

    p=2, m=2::

        d0  0F0 1F1 1BW1 0B0 0W0
        d1  0F1 1F0 1BW0 0B1 0W1
    """
    p, m = num_devices, num_microbatches
    if p % 2:
        raise ConfigError(f"dualpipe: number of devices ({p}) must be even (two pipelines of p stages share them)")
    if m % 2:
        raise ConfigError(f"dualpipe: number of micro-batches ({m}) must be even (half go down, half go up)")
    half, chunks = p // 2, m // 2
    _check_enough("dualpipe", m, 2 * p - 2, f"2p − 2 = {2 * p - 2}")
    devices = []
    for device in range(p):
        second_half = device >= half
        rank = min(device, p - 1 - device)
        stages = (device, p - 1 - device)  # (down, up) pipeline's stage on this device
        first_mb = (0, chunks)
        phases = [(stages[phase ^ second_half], first_mb[phase ^ second_half]) for phase in (0, 1)]
        middle = rank == half - 1
        devices.append(_ops(dual_steps(rank, half, chunks, middle), phases))
    return _keep_useful_pairs(Schedule.build("dualpipe", devices, num_stages=p, num_microbatches=m), costs)


@register(
    "dualpipev",
    family="dualpipe",
    paper="DeepSeek-AI 2025, DualPipeV (DualPipe cut in half; torch ScheduleDualPipeV)",
    summary="DualPipe's steps on a V (two half stages per device, one model copy): overlapped "
    "forward-backward pairs without DualPipe's 2× parameters",
    domain="p >= 1, m >= 2p - 1; costs (split the pairs that hide nothing)",
    options=("costs",),
    tuning=Tuning("dualpipev", layout="v", fallbacks=(), fewest_microbatches=_two_p_minus_1),
    pareto="fixed",
)
def dualpipev(num_devices: int, num_microbatches: int, costs: Costs | None = None) -> Schedule:
    """DualPipeV on p devices: 2p stages, device d runs stages d and 2p−1−d.

    p=1, m=1::

        d0  0F0 1F0 1BW0 0B0 0W0
    """
    p, m = num_devices, num_microbatches
    _check_enough("dualpipev", m, 2 * p - 1, f"2p − 1 = {2 * p - 1}")
    devices = []
    for device in range(p):
        phases = [(device, 0), (2 * p - 1 - device, 0)]
        devices.append(_ops(dual_steps(device, p, m, device == p - 1), phases))
    return _keep_useful_pairs(Schedule.build("dualpipev", devices, num_stages=2 * p, num_microbatches=m), costs)


def _keep_useful_pairs(schedule: Schedule, costs: Costs | None) -> Schedule:
    """Split the pairs that are no faster than their two ops one after the other."""
    if costs is None:
        return schedule
    table = costs.resolve(schedule.num_devices, schedule.num_stages)
    devices = []
    for ops in schedule.devices:
        kept = list(ops)
        for step, op in enumerate(ops):
            if not op.overlap_next:
                continue
            forward, backward = (op, ops[step + 1]) if op.kind is _F else (ops[step + 1], op)
            fused = backward.kind is _BW
            alone = table.F[forward.stage] + (table.BW if fused else table.B)[backward.stage]
            if table.pair_time(forward.stage, backward.stage, fused) >= alone - 1e-12 * alone:
                kept[step] = replace(op, overlap_next=False)
        devices.append(kept)
    return schedule.with_devices(devices)


def _check_enough(name: str, m: int, least: int, rule: str) -> None:
    if m < least:
        raise ConfigError(
            f"{name}: {m} micro-batches are too few; the steady state needs at least {rule} "
            f"(fewer leaves the first device with more forwards to run than micro-batches); use m >= {least}"
        )


Step = tuple[str, int, int]
"""("F", phase, 0), ("B", phase, zero_bubble), ("W", 0, 0) or ("FB", forward phase, backward phase)."""


def dual_steps(rank: int, ranks: int, chunks: int, middle: bool) -> list[Step]:
    """The eight steps of one device (module docstring) as (kind, phase, detail) tuples."""
    steps: list[Step] = []
    before_turn = ranks - rank - 1
    steps += [("F", 0, 0)] * (2 * before_turn)
    steps += [("F", 0, 0), ("F", 1, 0)] * (rank + 1)
    steps += [("B", 1, 1), ("W", 0, 0), ("F", 1, 0)] * before_turn
    for i in range(chunks - 2 * ranks + rank + 1):
        steps += [("F", 0, 0), ("B", 1, 0)] if i == 0 and middle else [("FB", 0, 1)]
        steps.append(("FB", 1, 0))
    steps += [("B", 1, 0), ("FB", 1, 0)] * before_turn
    zero_bubble = False
    for i in range(rank + 1):
        if i == (rank + 1) // 2 and rank % 2 == 1:
            zero_bubble = True
        steps.append(("B", 1, zero_bubble))
        if i == (rank + 1) // 2 and rank % 2 == 0:
            zero_bubble = True
        steps.append(("B", 0, zero_bubble))
    steps += [("W", 0, 0), ("B", 0, 1)] * before_turn
    steps += [("W", 0, 0)] * (rank + 1)
    return steps


def _ops(steps: list[Step], phases: list[tuple[int, int]]) -> list[Op]:
    """Number the steps' micro-batches per phase; `phases[q]` = (stage, first micro-batch)."""
    forwards, backwards = [0, 0], [0, 0]
    pending_w: deque[Op] = deque()
    ops: list[Op] = []

    def forward(phase: int, overlap: bool = False) -> Op:
        stage, first = phases[phase]
        forwards[phase] += 1
        return Op(_F, stage, first + forwards[phase] - 1, overlap_next=overlap)

    def backward(phase: int, zero_bubble: bool) -> Op:
        stage, first = phases[phase]
        backwards[phase] += 1
        op = Op(_B if zero_bubble else _BW, stage, first + backwards[phase] - 1)
        if zero_bubble:
            pending_w.append(Op(_W, op.stage, op.microbatch))
        return op

    for kind, phase, detail in steps:
        if kind == "F":
            ops.append(forward(phase))
        elif kind == "B":
            ops.append(backward(phase, bool(detail)))
        elif kind == "FB":
            ops += [forward(phase, overlap=True), backward(detail, False)]
        elif pending_w:  # a W with nothing queued (torch skips it too) is no op
            ops.append(pending_w.popleft())
    return ops
