"""The tuner (Mario §5.3): grid search over the plan space, every point simulated, with pruning.

For each candidate the layers are partitioned to balance stage time given the embedding and head
(`partition`), the cost model gives per-stage Costs, and then, cheapest check first:

1. static memory (weights, gradients, optimizer state) over the limit on some device under every
   static-memory measure (ZeRO-0, ZeRO-1, ZeRO-2, every stage's optimizer offloaded) → rejected;
2. a lower bound on the step — the busiest device's compute, plus the all-reduce and optimizer —
   no better than the `keep`-th best plan so far → pruned (candidates run in order of this bound,
   so good plans come early and prune the rest);
3. the schedule is built (memory-driven generators get the activation budget left after static
   memory) and simulated; over the limit, the scheme's memory-saving passes are tried in turn
   (Mario, T-Recomp, T-Offload), and the first that fits is kept. Only when none fits is the next
   static measure tried — each costs time (an all-gather of the weights, host copies), so a plan
   takes one only when it needs it.

Step time = the simulated pipeline (with offload lanes) + the data-parallel all-reduce of the
gradients + the optimizer step; throughput = global batch / step time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from pipeloom.costs import Costs
from pipeloom.errors import InfeasibleError, PipeloomError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.mario import mario
from pipeloom.passes.offload import simulate_offload, t_offload
from pipeloom.passes.trecomp import t_recomp
from pipeloom.passes.weight_parts import weight_parts
from pipeloom.schedules.registry import build_schedule, get_generator
from pipeloom.schedules.svpp import table3_forwards
from pipeloom.sim.simulate import simulate
from pipeloom.tune.bounds import ORDER_KEEPING, memory_floor, pipeline_floor
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.evaluation import Evaluation, TuneResult, packed, restore
from pipeloom.tune.measures import static_options
from pipeloom.tune.partition import partition_layers, partition_variants
from pipeloom.tune.pool import ROUND, RoundPool, default_jobs
from pipeloom.tune.space import DEFAULT_SCHEMES, GENERATOR_OF, SCHEMES, Candidate, candidates

__all__ = ["Evaluation", "TuneResult", "tune", "evaluate"]

_EPS = 1e-9
SLICED_OPS_LIMIT = 4_000
"""SVPP's list scheduler runs a dozen greedy passes in Python; beyond this many ops it is skipped."""
REFINED_PLANS = 3
"""The leading plans built again on other layer layouts (`_other_partitions`)."""


def tune(
    cost_model: CostModel,
    devices: int,
    memory: float,
    global_batch: int,
    *,
    tp: int = 1,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    pp_values: Sequence[int] | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    keep: int = 10,
    memory_passes: bool = True,
    static_measures: bool = True,
    exhaustive: bool = False,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
    ep: int = 1,
    layouts: bool = True,
) -> TuneResult:
    """The `keep` fastest plans that fit `memory` bytes per device; InfeasibleError if none does,
    naming the binding constraint. `memory_passes=False` leaves out Mario, T-Recomp and T-Offload;
    `static_measures=False` leaves out ZeRO-1/2 and offloading every stage's optimizer;
    `exhaustive` turns pruning off (for checking the pruning). `jobs` processes simulate
    candidates (None: every core this process may use); the result is the same for any. With
    `ep` > 1 the experts are shared out over groups of ep data-parallel replicas, so dp must
    be a multiple of ep. `layouts`: the leading plans are also built on other layer layouts
    than the balanced one (`_other_partitions`)."""
    points = [
        point
        for point in candidates(
            devices,
            global_batch,
            tp=tp,
            schemes=schemes,
            pp_values=pp_values,
            micro_batches=micro_batches,
            num_layers=cost_model.model.layers,
        )
        if point.dp % ep == 0
    ]
    if not points:
        raise InfeasibleError(
            f"no configuration of {devices} devices divides the global batch {global_batch} "
            f"(dp × micro-batch size must divide it, the stages must not outnumber {cost_model.model.layers} layers"
            + (f", and dp must be a multiple of ep = {ep})" if ep > 1 else ")")
        )
    prepared = [_prepare(point, cost_model, memory, static_measures) for point in points]
    prepared.sort(key=lambda item: item[1])
    ranked: list[Evaluation] = []
    rejected: list[Evaluation] = []
    evaluated = pruned = 0

    def threshold() -> float:
        return ranked[keep - 1].step_time if len(ranked) >= keep and not exhaustive else math.inf

    task = partial(_simulate_task, memory=memory, memory_passes=memory_passes)
    with RoundPool(task, jobs if jobs is not None else default_jobs(), pack=packed) as pool:
        for first in range(0, len(prepared), ROUND):
            batch = list(enumerate(prepared[first : first + ROUND], first))
            limit = threshold()
            todo = [index for index, (evaluation, bound) in batch if not evaluation.reason and bound < limit - _EPS]
            sent = [prepared[index][0] for index in todo]
            sizes = [_ops(evaluation.candidate) for evaluation in sent]
            results = dict(zip(todo, pool.run(sent, limit, sizes)))
            evaluated += len(todo)
            for index, (evaluation, bound) in batch:
                if index in results or not evaluation.reason:  # (a simulation may have set a reason)
                    if index not in results or bound >= threshold() - _EPS:
                        pruned += 1  # by the round's threshold, or by a plan found in this round
                        if progress:
                            progress(index + 1, len(prepared))
                        continue
                    evaluation, kept = results[index]
                    if not kept:
                        pruned += 1
                        if progress:
                            progress(index + 1, len(prepared))
                        continue
                if evaluation.feasible:
                    ranked.append(evaluation)
                    ranked.sort(key=lambda e: e.step_time)
                    del ranked[keep:]
                else:
                    rejected.append(evaluation)
                if progress:
                    progress(index + 1, len(prepared))
        if ranked and layouts:
            evaluated += _other_partitions(ranked, pool, cost_model, memory, static_measures)
    for evaluation in ranked:
        restore(evaluation)
    if not ranked:
        raise InfeasibleError(_binding_constraint(rejected, memory))
    return TuneResult(ranked, rejected, global_batch, memory, evaluated, pruned)


def _other_partitions(
    ranked: list[Evaluation], pool: RoundPool, cost_model: CostModel, memory: float, static_measures: bool
) -> int:
    """The leading plans built and simulated again on other layer layouts (`partition_variants`):
    the layout is chosen with the schedule, the balanced one being one input, not the only one.
    A layout that makes a plan faster replaces it, and the ranking is sorted again. Rebuilt, not
    re-timed: a budgeted generator's schedule for one layout's costs gains little on another's.
    How many were simulated."""
    leading = ranked[:REFINED_PLANS]
    sent: list[tuple[int, Evaluation]] = []
    for index, evaluation in enumerate(leading):
        base = replace(evaluation.candidate, passes=SCHEMES[evaluation.candidate.scheme].passes, zero=0)
        for layout in partition_variants(evaluation.partition):
            variant, bound = _prepare(base, cost_model, memory, static_measures, partition=layout)
            if not variant.reason and bound < evaluation.step_time - _EPS:
                sent.append((index, variant))
    limit = max(evaluation.step_time for evaluation in leading)
    results = pool.run([variant for _, variant in sent], limit, [_ops(variant.candidate) for _, variant in sent])
    for (index, _), (variant, _) in zip(sent, results):
        if variant.feasible and variant.step_time < ranked[index].step_time - _EPS:
            ranked[index] = variant
    ranked.sort(key=lambda e: e.step_time)
    return len(sent)


def evaluate(
    candidate: Candidate,
    cost_model: CostModel,
    memory: float,
    memory_passes: bool = True,
    static_measures: bool = True,
) -> Evaluation:
    """One candidate, fully (no pruning)."""
    evaluation, _ = _prepare(candidate, cost_model, memory, static_measures)
    if not evaluation.reason:
        _simulate_candidate(evaluation, memory, memory_passes=memory_passes)
    return evaluation


def _prepare(
    candidate: Candidate,
    cost_model: CostModel,
    memory: float,
    static_measures: bool = True,
    partition: list[int] | None = None,
) -> tuple[Evaluation, float]:
    """Partition (the balanced one unless given), the static-memory measures that fit, and a
    lower bound on the step time."""
    evaluation = Evaluation(candidate, overhead_time=cost_model.step_overhead_time())
    stages = candidate.num_stages
    ops = _ops(candidate)
    if candidate.slices > 1 and ops > SLICED_OPS_LIMIT:
        evaluation.reason = f"size: {ops} slice ops, beyond the {SLICED_OPS_LIMIT} the tuner builds SVPP for"
        return evaluation, math.inf
    mbs = candidate.micro_batch
    per_layer = cost_model.layer_time(mbs)
    first, last = cost_model.end_times(mbs)
    try:
        evaluation.partition = partition or partition_layers(
            cost_model.model.layers,
            [per_layer] * stages,
            [first] + [0.0] * (stages - 2) + [last] if stages > 1 else [first + last],
        )
    except InfeasibleError as error:
        evaluation.reason = f"layers: {error}"
        return evaluation, math.inf
    options = static_options(candidate, cost_model, evaluation.partition, static_measures)
    plain = options[0]
    evaluation.costs, evaluation.static_memory = plain.costs, plain.static_memory
    evaluation.allreduce_time, evaluation.optimizer_time = plain.allreduce_time, plain.optimizer_time
    evaluation.options = options
    fitting = [option for option in options if max(option.static_memory) <= memory]
    if not fitting:
        least = min(options, key=lambda option: max(option.static_memory))
        worst = max(least.static_memory)
        device = least.static_memory.index(worst)
        evaluation.static_memory = least.static_memory
        evaluation.reason = (
            f"memory: static {_gib(worst)} on device {device} exceeds {_gib(memory)} before any activation"
            + (f", even with {least.label}" if len(options) > 1 else "")
        )
        return evaluation, math.inf
    extra = min(option.allreduce_time + option.optimizer_time for option in fitting)
    return evaluation, pipeline_floor(candidate, plain.costs) + extra + evaluation.overhead_time


_RESULT_FIELDS = (
    "candidate", "costs", "schedule", "timeline", "offload", "pipeline_time", "allreduce_time",
    "optimizer_time", "static_memory", "peak_memory",
)  # fmt: skip


def _simulate_task(evaluation: Evaluation, threshold: float, memory: float, memory_passes: bool):
    """One candidate simulated: (the evaluation, whether it was kept)."""
    kept = _simulate_candidate(evaluation, memory, threshold, memory_passes)
    return evaluation, kept


def _simulate_candidate(
    evaluation: Evaluation, memory: float, threshold: float = math.inf, memory_passes: bool = True
) -> bool:
    """Build and simulate under each static-memory measure in turn, falling back to the scheme's
    memory-saving passes within each, and keep the fastest plan that fits. ZeRO-1 is always
    weighed against ZeRO-0 (its optimizer step is 1/dp and a budgeted generator gets more room,
    against an all-gather of the weights); ZeRO-2 (bf16 gradient accumulation) only while memory
    is short — when nothing fits without a memory-saving pass; offload only when nothing fits at
    all. False if it cannot beat `threshold` (the plain schedule, which every pass only
    lengthens, already takes that long)."""
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
            if floor + option.allreduce_time + option.optimizer_time >= bar - _EPS:
                cut.append(True)
                continue
        if best is not None:
            plainly = best["candidate"].passes == candidate.passes  # fits without a memory-saving pass
            if option.offload_all or (option.zero == 2 and plainly):
                break  # ZeRO-2 only when memory is short, offload only when nothing else fits
            extra = option.allreduce_time + option.optimizer_time
            if extra >= best["allreduce_time"] + best["optimizer_time"] - _EPS and not spec.budgeted and plainly:
                continue  # the same schedule, with a dearer step around it
        costs = evaluation.costs = option.costs
        evaluation.allreduce_time, evaluation.optimizer_time = option.allreduce_time, option.optimizer_time
        budget = [memory - static for static in option.static_memory]
        try:
            if built is None or _uses_budget(candidate):  # else the measures share one schedule
                built = _generate(candidate, costs, budget)
            schedule = built
        except PipeloomError as error:
            evaluation.reason = f"schedule: {error.summary}"
            cut.append(False)
            continue
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
                    evaluation.reason = f"memory: device {device} needs at least {_gib(least[device])} > {_gib(memory)}"
                    continue
            try:
                current = schedule
                for name in candidate.passes + passes:
                    current = _apply(name, current, costs, budget)
            except PipeloomError as error:
                evaluation.reason = f"memory: {error.summary}"
                continue
            if "offload" in passes or "offload-all" in passes:
                stages = range(current.num_stages) if "offload-all" in passes else None
                offload = simulate_offload(t_offload(current, stages), costs)
                timeline, pipeline = offload.timeline, offload.step_time
            else:
                offload, timeline = None, simulate(current, costs)
                pipeline = timeline.makespan
            peaks = timeline.peak_memory
            if not simulated and floor is None and not (option.offload_all or candidate.passes + passes):
                floor = pipeline
            simulated = True
            evaluation.candidate = candidate.with_passes(candidate.passes + passes, zero=option.zero)
            evaluation.schedule, evaluation.timeline, evaluation.offload = current, timeline, offload
            evaluation.pipeline_time, evaluation.peak_memory = pipeline, peaks
            evaluation.allreduce_time = option.allreduce_time + option.replica_skew * pipeline
            evaluation.static_memory = list(timeline.static_memory)
            if max(peaks) <= memory + _EPS:
                if best is None or evaluation.step_time < best["step_time"] - _EPS:
                    best = {name: getattr(evaluation, name) for name in _RESULT_FIELDS}
                    best["step_time"] = evaluation.step_time
                break
            device = peaks.index(max(peaks))
            evaluation.reason = f"memory: device {device} peaks at {_gib(peaks[device])} > {_gib(memory)}"
            evaluation.unfit.append((evaluation.candidate.label, evaluation.step_time, evaluation.reason))
    if best is None:
        return not (cut and all(cut))
    for name in _RESULT_FIELDS:
        setattr(evaluation, name, best[name])
    evaluation.feasible, evaluation.reason = True, ""
    return True


def _uses_budget(candidate: Candidate) -> bool:
    """Whether the generator reads the memory budget (so each static measure builds its own)."""
    spec = SCHEMES[candidate.scheme]
    return spec.budgeted and not spec.table3_forwards


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
        kwargs["forwards"] = table3_forwards(candidate.pp, candidate.chunks, candidate.slices)
    elif _uses_budget(candidate):
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


def _ops(candidate: Candidate) -> int:
    """How many ops its schedule has: a guess at how long it takes to build and simulate."""
    return 2 * candidate.num_stages * candidate.num_microbatches * candidate.slices


def _binding_constraint(rejected: list[Evaluation], memory: float) -> str:
    """The constraint that ruled out the configuration closest to fitting."""
    measured = [e for e in rejected if e.peak_memory or e.static_memory]
    if measured:
        closest = min(measured, key=lambda e: max(e.peak_memory or e.static_memory))
        need = max(closest.peak_memory or closest.static_memory)
        return (
            f"no plan fits {_gib(memory)} per device: the least any configuration needs is {_gib(need)} "
            f"({closest.candidate.label}; {closest.reason})"
        )
    reasons = sorted({e.reason.split(":")[0] for e in rejected})
    return f"no plan fits: every configuration was ruled out ({', '.join(reasons)}); e.g. {rejected[0].reason}"


def _gib(value: float) -> str:
    return f"{value / 2**30:.2f} GiB"
