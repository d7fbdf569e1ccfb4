"""T-Offload (TPipe §5, appendix D): deep chunks' optimizer work moves to the host, into bubbles.

A deep chunk's weights are needed briefly — its forwards come last in the warm-up and its
backwards first in the cool-down — so its model state has poor temporal locality. T-Offload keeps
only its weights on the device: after the chunk's last backward its gradients go to the host
(OFFLOAD), the host runs its optimizer step (HOST_STEP), and the new weights, optionally quantized,
come back before the chunk's first forward of the next step (RELOAD). The device no longer holds
the chunk's optimizer state and gradients between steps (M_offload of the costs).

These ops are not compute: OFFLOAD and RELOAD run on the device's copy engine, HOST_STEP on its
host, each lane one op at a time, beside the schedule. They cost time only where they do not fit
their bubble: a RELOAD that ends after the chunk's first forward would have started delays that
forward (and what depends on it) by the overflow; a HOST_STEP that ends after the step would
have ended delays the next step by the overflow, since the next step starts once the host has
stepped every offloaded chunk.

Copies share the host link with p2p transfers where p2p crosses PCIe: while a transfer leaves
the device an OFFLOAD (device → host, the same direction) runs at 1 − p2p_host_link_share of its
rate, and while one arrives a RELOAD does (the link is full duplex). Reload ends and forward
delays feed each other, so they are iterated to a fixed point.

Two shares are reported. The overlap fraction is the share of the lanes' work that runs while
its device computes nothing (TPipe Fig. 15's quantity: work hidden in bubbles, not contending
with compute for memory bandwidth and SMs, §5.2). The on-time fraction is the share that ends
before its deadline, so costs the step nothing. The windows are the idle time each offloaded
stage has for its work: before its first forward (reload) and after its last weight gradient
(offload and host step); TPipe appendix D derives them for T-Pipe, and `tpipe` meets them.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from enum import StrEnum

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.intervals import finish_time, idle_intervals, link_transfers, overlap
from pipeloom.sim.simulate import Timeline, simulate

__all__ = [
    "LaneOpKind",
    "LaneOp",
    "LaneWindow",
    "OffloadPlan",
    "OffloadTimeline",
    "t_offload",
    "simulate_offload",
]

_EPS = 1e-9
_MAX_ROUNDS = 16


class LaneOpKind(StrEnum):
    OFFLOAD = "OFFLOAD"
    """Gradients of a stage, device → host (copy engine)."""
    HOST_STEP = "HOST_STEP"
    """The optimizer step of a stage, on the host CPU."""
    RELOAD = "RELOAD"
    """Updated weights of a stage, host → device (copy engine), optionally quantized."""

    @property
    def lane(self) -> str:
        return "host" if self is LaneOpKind.HOST_STEP else "copy"


@dataclass(frozen=True, slots=True)
class LaneOp:
    kind: LaneOpKind
    stage: int
    device: int
    start: float
    end: float
    deadline: float
    """When its bubble ends: the stage's first forward (RELOAD) or the step's end (the others)."""

    @property
    def exposed(self) -> float:
        """The part of the op that runs past its bubble."""
        return max(0.0, min(self.end - self.start, self.end - self.deadline))

    @property
    def text(self) -> str:
        return f"{self.stage}{self.kind.value}"


@dataclass(frozen=True, slots=True)
class LaneWindow:
    """The idle time an offloaded stage's lane work can hide in, on one device."""

    stage: int
    device: int
    reload: float
    """Idle time before the stage's first forward."""
    offload: float
    """Idle time after the stage's last weight gradient, until the step ends."""


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    schedule: Schedule
    stages: tuple[int, ...]
    """Stages whose optimizer work runs on the host."""
    reload_bits: int = 16
    """Bits per weight of the reload (16 = unquantized)."""


def t_offload(schedule: Schedule, stages: Collection[int] | None = None, reload_bits: int = 16) -> OffloadPlan:
    """Offload `stages` (default: every stage but each device's shallowest) of `schedule`."""
    if stages is None:
        chosen = sorted(stage for d in range(schedule.num_devices) for stage in sorted(schedule.stages_on(d))[1:])
        if not chosen:
            raise ConfigError(
                f"t_offload: every device of {schedule.name!r} hosts one stage, so none is deeper than another; "
                "name the stages to offload"
            )
    else:
        chosen = sorted(set(stages))
        bad = [stage for stage in chosen if not isinstance(stage, int) or not 0 <= stage < schedule.num_stages]
        if bad or not chosen:
            raise ConfigError(f"t_offload: stages must be among 0..{schedule.num_stages - 1}, got {sorted(stages)}")
    if not isinstance(reload_bits, int) or isinstance(reload_bits, bool) or not 1 <= reload_bits <= 16:
        raise ConfigError(f"t_offload: reload_bits must be an integer from 1 to 16, got {reload_bits!r}")
    return OffloadPlan(schedule, tuple(chosen), reload_bits)


@dataclass(frozen=True)
class OffloadTimeline:
    plan: OffloadPlan
    timeline: Timeline
    """The schedule's compute, with each first forward of an offloaded stage after its reload."""
    baseline: Timeline
    """The same schedule without offloading."""
    lane_ops: list[LaneOp]
    step_time: float
    """Until the last of compute and host work: when the next step may start."""
    static_memory_saved: list[float]
    """Per device; `timeline.static_memory` is what remains."""
    windows: list[LaneWindow]
    """Per offloaded (device, stage), measured on the schedule without offloading."""
    host_memory: list[float]
    """Per device: what its host holds for the offloaded stages (M_host)."""

    @property
    def delay(self) -> float:
        return self.step_time - self.baseline.makespan

    @property
    def overlap_fraction(self) -> float:
        """Share of the lanes' work done in its device's bubbles: while the device computes nothing,
        before the op's deadline (1 when there is no work)."""
        total = sum(op.end - op.start for op in self.lane_ops)
        if total <= _EPS:
            return 1.0
        idle = [idle_intervals(self.timeline, device) for device in range(self.timeline.num_devices)]
        # past its deadline the device idles because of the op itself: that is delay, not a bubble
        return sum(overlap(op.start, min(op.end, op.deadline), idle[op.device]) for op in self.lane_ops) / total

    @property
    def on_time_fraction(self) -> float:
        """Share of the lanes' work done before its deadline, so at no cost to the step."""
        total = sum(op.end - op.start for op in self.lane_ops)
        return 1.0 - sum(op.exposed for op in self.lane_ops) / total if total > _EPS else 1.0

    @property
    def static_memory(self) -> list[float]:
        return self.timeline.static_memory

    def summary(self) -> dict:
        return {
            "stages": list(self.plan.stages),
            "reload_bits": self.plan.reload_bits,
            "step_time": self.step_time,
            "baseline_step_time": self.baseline.makespan,
            "delay": self.delay,
            "overlap_fraction": self.overlap_fraction,
            "on_time_fraction": self.on_time_fraction,
            "windows": [
                {"device": w.device, "stage": w.stage, "reload": w.reload, "offload": w.offload} for w in self.windows
            ],
            "static_memory": self.static_memory,
            "static_memory_saved": self.static_memory_saved,
            "host_memory": self.host_memory,
            "peak_memory": self.timeline.peak_memory,
            "lane_ops": [
                {
                    "op": op.kind.value,
                    "stage": op.stage,
                    "device": op.device,
                    "lane": op.kind.lane,
                    "start": op.start,
                    "end": op.end,
                    "deadline": op.deadline,
                }
                for op in self.lane_ops
            ],
        }


def simulate_offload(plan: OffloadPlan, costs: Costs) -> OffloadTimeline:
    """Time the plan's compute and its copy and host lanes together (see the module docstring)."""
    schedule = plan.schedule
    durations = _lane_durations(plan, costs)
    saved_per_stage = _offloaded_static(plan, costs)
    baseline = simulate(schedule, costs)
    first_forward, last_backward = _weight_uses(schedule, set(plan.stages))
    slowed = 1.0 - costs.p2p_host_link_share

    timeline = baseline
    for _ in range(_MAX_ROUNDS if costs.comm > 0 and slowed < 1 else 1):
        reloads = _reloads(timeline, baseline, first_forward, durations[LaneOpKind.RELOAD], slowed)
        not_before = {first_forward[op.device, op.stage]: op.end for op in reloads}
        previous, timeline = timeline, simulate(schedule, costs, not_before)
        if timeline.end == previous.end:
            break  # the transfers the reloads yielded to have not moved: a fixed point

    sends, _ = link_transfers(timeline)
    copy_free = [max((op.end for op in reloads if op.device == d), default=0.0) for d in range(schedule.num_devices)]
    host_free = [0.0] * schedule.num_devices
    lane_ops = list(reloads)
    ends = _times(timeline, last_backward.values(), end=True)
    step_end = baseline.makespan
    for device, stage in sorted(last_backward, key=lambda unit: ends[last_backward[unit]]):
        start = max(copy_free[device], ends[last_backward[device, stage]])
        end = copy_free[device] = finish_time(start, durations[LaneOpKind.OFFLOAD][stage], sends[device], slowed)
        lane_ops.append(LaneOp(LaneOpKind.OFFLOAD, stage, device, start, end, step_end))
        start = max(host_free[device], end)
        end = host_free[device] = start + durations[LaneOpKind.HOST_STEP][stage]
        lane_ops.append(LaneOp(LaneOpKind.HOST_STEP, stage, device, start, end, step_end))

    saved = [0.0] * schedule.num_devices
    host = [0.0] * schedule.num_devices
    host_per_stage = costs.per_slice("M_host", schedule.num_devices, schedule.num_stages)
    for device, stage in first_forward:
        saved[device] += saved_per_stage[stage]
        host[device] += host_per_stage[stage]
    static = [before - s for before, s in zip(baseline.static_memory, saved)]
    return OffloadTimeline(
        plan=plan,
        timeline=replace(timeline, static_memory=static),
        baseline=baseline,
        lane_ops=lane_ops,
        step_time=max([timeline.makespan] + [op.end for op in lane_ops]),
        static_memory_saved=saved,
        windows=_windows(baseline, first_forward, last_backward),
        host_memory=host,
    )


def _reloads(
    timeline: Timeline,
    baseline: Timeline,
    first_forward: dict[tuple[int, int], Op],
    seconds: list[float],
    slowed: float,
) -> list[LaneOp]:
    """Each device's reloads in the order its forwards need them, slowed by the p2p transfers that
    arrive at the device in `timeline`; each is due when its forward starts without offloading."""
    _, receives = link_transfers(timeline)
    due = _times(baseline, first_forward.values(), end=False)
    copy_free = [0.0] * baseline.num_devices
    reloads = []
    for device, stage in sorted(first_forward, key=lambda unit: due[first_forward[unit]]):
        start = copy_free[device]
        end = copy_free[device] = finish_time(start, seconds[stage], receives[device], slowed)
        reloads.append(LaneOp(LaneOpKind.RELOAD, stage, device, start, end, due[first_forward[device, stage]]))
    return reloads


def _windows(
    baseline: Timeline, first_forward: dict[tuple[int, int], Op], last_backward: dict[tuple[int, int], Op]
) -> list[LaneWindow]:
    starts = _times(baseline, first_forward.values(), end=False)
    ends = _times(baseline, last_backward.values(), end=True)
    idle = [idle_intervals(baseline, device) for device in range(baseline.num_devices)]
    windows = []
    for device, stage in sorted(first_forward):
        backward = last_backward.get((device, stage))
        last = ends.get(backward, baseline.makespan) if backward is not None else baseline.makespan
        windows.append(
            LaneWindow(
                stage=stage,
                device=device,
                reload=overlap(0.0, starts[first_forward[device, stage]], idle[device]),
                offload=overlap(last, baseline.makespan, idle[device]),
            )
        )
    return windows


def _offloaded_static(plan: OffloadPlan, costs: Costs) -> list[float]:
    """M_offload per stage, checked to be part of M_static."""
    p, num_stages = plan.schedule.num_devices, plan.schedule.num_stages
    saved = costs.per_slice("M_offload", p, num_stages)
    static = costs.per_slice("M_static", p, num_stages)
    for stage in plan.stages:
        if saved[stage] > static[stage] + _EPS:
            raise ConfigError(
                f"costs: M_offload of stage {stage} ({saved[stage]:g}) exceeds its M_static ({static[stage]:g}); "
                "M_offload is the part of M_static that leaves the device"
            )
    return saved


def _lane_durations(plan: OffloadPlan, costs: Costs) -> dict[LaneOpKind, list[float]]:
    p, num_stages = plan.schedule.num_devices, plan.schedule.num_stages
    moved = {
        LaneOpKind.OFFLOAD: costs.per_slice("offload_bytes", p, num_stages),
        LaneOpKind.RELOAD: [b * plan.reload_bits / 16 for b in costs.per_slice("reload_bytes", p, num_stages)],
    }
    flops = costs.per_slice("host_step_flops", p, num_stages)
    bandwidth, host_flops = costs.host_bandwidth, costs.host_flops
    if any(moved[kind][s] for kind in moved for s in plan.stages) and bandwidth is None:
        raise ConfigError("T-Offload moves bytes: give costs host_bandwidth (bytes per time unit)")
    if any(flops[s] for s in plan.stages) and host_flops is None:
        raise ConfigError("T-Offload runs host_step_flops on the host: give costs host_flops (FLOPs per time unit)")
    out = {kind: [_divide(b, bandwidth) for b in values] for kind, values in moved.items()}
    out[LaneOpKind.HOST_STEP] = [_divide(f, host_flops) for f in flops]
    return out


def _weight_uses(schedule: Schedule, stages: set[int]) -> tuple[dict[tuple[int, int], Op], dict[tuple[int, int], Op]]:
    """Per (device, stage) hosting an offloaded stage: its first forward (needs the weights) and
    its last weight-gradient op (W or BW). A replicated stage (Chimera) counts once per device."""
    first: dict[tuple[int, int], Op] = {}
    last: dict[tuple[int, int], Op] = {}
    for device, ops in enumerate(schedule.devices):
        for op in ops:
            if op.stage not in stages:
                continue
            if op.kind is OpKind.F:
                first.setdefault((device, op.stage), op)
            elif op.kind in (OpKind.W, OpKind.BW):
                last[device, op.stage] = op
    return first, last


def _times(timeline: Timeline, ops, end: bool) -> dict[Op, float]:
    """Start (or end) of each of `ops` in `timeline`."""
    wanted = set(ops)
    return {t.op: (t.end if end else t.start) for t in timeline.timings() if t.op in wanted}


def _divide(amount: float, rate: float | None) -> float:
    """Time to move or compute `amount` at `rate`; nothing to do takes no time (and no rate)."""
    if not amount:
        return 0.0
    assert rate is not None, "checked by _lane_durations"
    return amount / rate
