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
stepped every offloaded chunk. The overlap fraction is the share of the lanes' work done inside
the bubbles (TPipe Fig. 15's quantity).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace
from enum import StrEnum

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.sim.simulate import Timeline, simulate

__all__ = ["LaneOpKind", "LaneOp", "OffloadPlan", "OffloadTimeline", "t_offload", "simulate_offload"]

_EPS = 1e-9


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

    @property
    def delay(self) -> float:
        return self.step_time - self.baseline.makespan

    @property
    def overlap_fraction(self) -> float:
        """Share of the lanes' work inside bubbles (1 when there is none)."""
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
            "static_memory": self.static_memory,
            "static_memory_saved": self.static_memory_saved,
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
    p = schedule.num_devices
    durations = _lane_durations(plan, costs)
    saved_per_stage = _offloaded_static(plan, costs)
    baseline = simulate(schedule, costs)
    first_forward, last_backward = _weight_uses(schedule, set(plan.stages))
    baseline_start = _times(baseline, first_forward.values(), end=False)

    lane_ops: list[LaneOp] = []
    copy_free = [0.0] * p
    not_before: dict[Op, float] = {}
    for device, stage in sorted(first_forward, key=lambda unit: baseline_start[first_forward[unit]]):
        forward = first_forward[device, stage]
        start = copy_free[device]
        end = copy_free[device] = start + durations[LaneOpKind.RELOAD][stage]
        lane_ops.append(LaneOp(LaneOpKind.RELOAD, stage, device, start, end, baseline_start[forward]))
        not_before[forward] = end
    timeline = simulate(schedule, costs, not_before) if not_before else baseline

    host_free = [0.0] * p
    ends = _times(timeline, last_backward.values(), end=True)
    step_end = baseline.makespan
    for device, stage in sorted(last_backward, key=lambda unit: ends[last_backward[unit]]):
        start = max(copy_free[device], ends[last_backward[device, stage]])
        end = copy_free[device] = start + durations[LaneOpKind.OFFLOAD][stage]
        lane_ops.append(LaneOp(LaneOpKind.OFFLOAD, stage, device, start, end, step_end))
        start = max(host_free[device], end)
        end = host_free[device] = start + durations[LaneOpKind.HOST_STEP][stage]
        lane_ops.append(LaneOp(LaneOpKind.HOST_STEP, stage, device, start, end, step_end))

    saved = [0.0] * p
    for device, stage in first_forward:
        saved[device] += saved_per_stage[stage]
    static = [before - s for before, s in zip(baseline.static_memory, saved)]
    return OffloadTimeline(
        plan=plan,
        timeline=replace(timeline, static_memory=static),
        baseline=baseline,
        lane_ops=lane_ops,
        step_time=max([timeline.makespan] + [op.end for op in lane_ops]),
        static_memory_saved=saved,
    )


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
    if any(moved[kind][s] for kind in moved for s in plan.stages) and costs.host_bandwidth is None:
        raise ConfigError("T-Offload moves bytes: give costs host_bandwidth (bytes per time unit)")
    if any(flops[s] for s in plan.stages) and costs.host_flops is None:
        raise ConfigError("T-Offload runs host_step_flops on the host: give costs host_flops (FLOPs per time unit)")
    out = {kind: [b / costs.host_bandwidth if b else 0.0 for b in values] for kind, values in moved.items()}
    out[LaneOpKind.HOST_STEP] = [f / costs.host_flops if f else 0.0 for f in flops]
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
