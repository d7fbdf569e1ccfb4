"""One candidate built and simulated: under each static-memory measure that fits, its schedule
(budgeted generators fitted to the room the measure leaves), then the scheme's passes and, over
the limit, its memory-saving chains; the fastest plan that fits is kept (`tune.search` decides
which candidates get here)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeloom.costs import Costs
from pipeloom.errors import PipeloomError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.mario import mario
from pipeloom.passes.offload import OffloadTimeline
from pipeloom.passes.split_backward import fold_w_at_once
from pipeloom.passes.trecomp import t_recomp
from pipeloom.passes.weight_parts import weight_parts
from pipeloom.provenance import byte_size
from pipeloom.schedules.registry import build_schedule, get_generator
from pipeloom.schedules.svpp import svpp_within, table3_forwards
from pipeloom.sim.grad_sync import exposed_sync
from pipeloom.sim.simulate import simulate
from pipeloom.tune.bounds import ORDER_KEEPING, memory_floor
from pipeloom.tune.evaluation import Evaluation, offload_lanes
from pipeloom.tune.space import GENERATOR_OF, SCHEMES, Candidate

__all__ = ["simulate_task", "simulate_candidate", "most_room", "record_timing"]

_EPS = 1e-9


_RESULT_FIELDS = (
    "candidate", "costs", "schedule", "timeline", "offload", "pipeline_time", "allreduce_time",
    "optimizer_time", "static_memory", "peak_memory", "host_memory",
)  # fmt: skip


def simulate_task(
    evaluation: Evaluation, threshold: float, memory: float, memory_passes: bool, host_memory: float = math.inf
):
    """One candidate simulated: (the evaluation, whether it was kept)."""
    kept = simulate_candidate(evaluation, memory, threshold, memory_passes, host_memory)
    return evaluation, kept


def simulate_candidate(
    evaluation: Evaluation,
    memory: float,
    threshold: float = math.inf,
    memory_passes: bool = True,
    host_memory: float = math.inf,
) -> bool:
    """Build and simulate under each static-memory measure in turn, falling back to the scheme's
    memory-saving passes within each, and keep the fastest plan that fits. ZeRO-1 is always
    weighed against ZeRO-0 (its optimizer step is 1/dp and a budgeted generator gets more room,
    against an all-gather of the weights); ZeRO-2 (bf16 gradient accumulation) only while memory
    is short — when nothing fits without a memory-saving pass; offload only when nothing fits at
    all. A plan whose offloaded stages need more than `host_memory` bytes of some device's host
    does not fit either. False if it cannot beat `threshold` (the plain schedule, which every pass
    only lengthens, already takes that long)."""
    candidate = evaluation.candidate
    spec = SCHEMES[candidate.scheme]
    chains = ((),) + (spec.fallbacks if memory_passes else ())
    fitting = [option for option in evaluation.options if max(option.static_memory) <= memory]
    best: dict | None = None
    cut = []  # per measure tried: whether the bar cut its chains short
    floor = None  # the first plain schedule's pipeline: no measure shortens a schedule it does not rebuild
    built = None
    for option in fitting:
        bar = min(threshold, best["step_time"] if best else math.inf)
        if floor is not None and not spec.budgeted:
            if floor + option.sync_floor + option.optimizer_time >= bar - _EPS:
                cut.append(True)
                continue
        if best is not None:
            plainly = best["candidate"].passes == candidate.passes  # fits without a memory-saving pass
            if option.offload_all or (option.zero == 2 and plainly):
                break  # ZeRO-2 only when memory is short, offload only when nothing else fits
            extra = option.sync_floor + option.optimizer_time
            if extra >= best["allreduce_time"] + best["optimizer_time"] - _EPS and not spec.budgeted and plainly:
                continue  # the same schedule, with a dearer step around it
        costs = evaluation.costs = option.costs
        evaluation.allreduce_time, evaluation.optimizer_time = option.allreduce_time, option.optimizer_time
        budget = [memory - static for static in option.static_memory]
        try:
            if built is None or _uses_budget(candidate):  # else the measures share one schedule
                room = budget if _uses_budget(candidate) else most_room(fitting, memory)
                built = _generate(candidate, costs, room)
            schedule = built
        except PipeloomError as error:
            evaluation.reason = f"schedule: {error.summary}"
            cut.append(False)
            if _uses_budget(candidate):
                continue
            break  # the one build every measure shares
        cut.append(False)
        simulated = False  # this measure's first chain, which every later one only lengthens
        option_chains = [chain + ("offload-all",) for chain in chains] if option.offload_all else chains
        for passes in option_chains:
            if simulated and evaluation.step_time >= bar - _EPS:
                cut[-1] = True
                break
            if "wparts" in candidate.passes + passes and set(candidate.passes + passes) <= ORDER_KEEPING:
                least = memory_floor(schedule, costs)
                if max(least) > memory + _EPS:  # no placement of its W can make it fit: skip the passes
                    device = least.index(max(least))
                    evaluation.reason = (
                        f"memory: device {device} needs at least {byte_size(least[device], 2)} > {byte_size(memory, 2)}"
                    )
                    continue
            try:
                current = schedule
                for name in candidate.passes + passes:
                    current = _apply(name, current, costs, budget)
                current = fold_w_at_once(current)  # as the runtime runs a W with nothing to fill: in its B
            except PipeloomError as error:
                evaluation.reason = f"memory: {error.summary}"
                continue
            offload = offload_lanes(current, costs, candidate.passes + passes)
            host = offload.host_memory if offload else [0.0]
            if max(host) > host_memory + _EPS:
                device = host.index(max(host))
                evaluation.reason = f"host memory: device {device}'s host holds {byte_size(host[device], 2)} > {byte_size(host_memory, 2)}"
                need = max(host)  # what the limit ruled out, for the message when nothing fits
                evaluation.host_short = min(evaluation.host_short, need) if evaluation.host_short else need
                continue
            evaluation.candidate = candidate.with_passes(candidate.passes + passes, zero=option.zero)
            record_timing(evaluation, option, current, offload)
            pipeline, peaks = evaluation.pipeline_time, evaluation.peak_memory
            if not simulated and floor is None and not (option.offload_all or candidate.passes + passes):
                floor = pipeline
            simulated = True
            if max(peaks) <= memory + _EPS:
                if best is None or evaluation.step_time < best["step_time"] - _EPS:
                    best = {name: getattr(evaluation, name) for name in _RESULT_FIELDS}
                    best["step_time"] = evaluation.step_time
                break
            device = peaks.index(max(peaks))
            evaluation.reason = (
                f"memory: device {device} peaks at {byte_size(peaks[device], 2)} > {byte_size(memory, 2)}"
            )
            evaluation.unfit.append((evaluation.candidate.label, evaluation.step_time, evaluation.reason))
    if best is None:
        return not (cut and all(cut))
    for name in _RESULT_FIELDS:
        setattr(evaluation, name, best[name])
    evaluation.feasible, evaluation.reason = True, ""
    return True


def record_timing(evaluation: Evaluation, option, schedule: Schedule, offload: OffloadTimeline | None) -> None:
    """`schedule` (with `offload`'s lanes, if any) simulated under `option`'s costs, and its step
    parts set on `evaluation`."""
    timeline = offload.timeline if offload else simulate(schedule, option.costs)
    pipeline = offload.step_time if offload else timeline.makespan
    evaluation.costs, evaluation.schedule = option.costs, schedule
    evaluation.timeline, evaluation.offload = timeline, offload
    evaluation.pipeline_time, evaluation.peak_memory = pipeline, timeline.peak_memory
    evaluation.host_memory = list(offload.host_memory) if offload else []
    sync = option.allreduce_time
    if option.stage_sync and offload is None:  # each stage's all-reduce under the later ops, which
        exposed = exposed_sync(timeline, option.stage_sync)  # lose a share of what they hide
        sync = exposed + option.sync_contention * max(0.0, sync - exposed)
    # the wait for the slowest replica, at the first collective after the pipeline: ZeRO-0's
    # all-reduce, ZeRO-1/2's reduce-scatter, both in the runtime's sync phase
    evaluation.allreduce_time = sync + option.tp_sum + option.replica_skew * pipeline
    evaluation.optimizer_time = option.optimizer_time
    evaluation.static_memory = list(timeline.static_memory)


def _uses_budget(candidate: Candidate) -> bool:
    """Whether the generator reads the memory budget (so each static measure builds its own)."""
    spec = SCHEMES[candidate.scheme]
    return spec.budgeted and not spec.table3_forwards


def most_room(options: Sequence, memory: float) -> list[float]:
    """Per device, the activation memory the most frugal static measure leaves: a schedule
    shared by every measure is built to fit that one, and checked against each."""
    return [memory - min(statics) for statics in zip(*(option.static_memory for option in options))]


def _generate(candidate: Candidate, costs: Costs, budget: list[float]) -> Schedule:
    spec, generator = SCHEMES[candidate.scheme], GENERATOR_OF[candidate.scheme]
    options = get_generator(generator).options
    kwargs: dict = {}
    if "num_chunks" in options and (candidate.chunks > 1 or spec.table3_forwards):
        kwargs["num_chunks"] = candidate.chunks
    if "num_slices" in options:
        kwargs["num_slices"] = candidate.slices
    if "costs" in options:
        kwargs["costs"] = costs
    if spec.table3_forwards:  # one build, where searching the forwards would take many
        forwards = table3_forwards(candidate.pp, candidate.chunks, candidate.slices)
        return svpp_within(
            candidate.pp, candidate.num_microbatches, candidate.chunks, candidate.slices, forwards, costs, budget
        )
    if _uses_budget(candidate):
        kwargs["mem_limit"] = budget
    return build_schedule(generator, candidate.pp, candidate.num_microbatches, **kwargs)


def _apply(name: str, schedule: Schedule, costs: Costs, budget: list[float]) -> Schedule:
    if name == "mario":
        return mario(schedule, costs, budget)
    if name == "trecomp":
        return t_recomp(schedule)
    if name == "wparts":
        return weight_parts(schedule, costs, mem_limit=budget)
    if name in ("offload", "offload-all"):
        return schedule  # a plan layer, simulated beside the schedule
    raise AssertionError(name)
