"""The tuner (Mario §5.3): grid search over the plan space, every point simulated, with pruning.

For each candidate the layers are partitioned to balance stage time given the embedding and head
(`partition`), the cost model gives per-stage Costs, and then, cheapest check first:

1. static memory (weights, gradients, optimizer state) over the limit on some device under every
   static-memory measure (ZeRO-0, ZeRO-1, ZeRO-2, every stage's optimizer offloaded) → rejected;
2. a lower bound on the step (`bounds`) — each device's warm-up and work or, for budgeted
   schemes, the micro-batches its activation room lets through at once, plus the all-reduce and
   optimizer — no better than the `keep`-th best plan so far → pruned (candidates run in order
   of this bound, so good plans come early and prune the rest);
3. the schedule is built (`candidate_run`; memory-driven generators get the activation budget
   left after static memory) and simulated; over the limit, the scheme's memory-saving passes are tried in turn
   (Mario, T-Recomp, T-Offload), and the first that fits is kept. Only when none fits is the next
   static measure tried — each costs time (an all-gather of the weights, host copies), so a plan
   takes one only when it needs it.

Step time = the simulated pipeline (with offload lanes) + the data-parallel all-reduce of the
gradients + the optimizer step; throughput = global batch / step time. From a measured profile,
the ranked plans' pipelines then take the machine's step-to-step speed noise into account
(`speed_noise`) and are ranked again, and near-ties within the profile's noise are broken by
robustness (`confidence`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from pipeloom.errors import ConfigError, InfeasibleError
from pipeloom.provenance import byte_size
from pipeloom.tune.bounds import pipeline_floor, room_floor
from pipeloom.tune.candidate_run import (
    most_room,
    record_timing,
    simulate_candidate,
    simulate_task,
)
from pipeloom.tune.confidence import measured_first, note_extrapolations, settle_near_ties
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.evaluation import Evaluation, SplitOutcome, TuneResult, offload_lanes, packed, restore
from pipeloom.tune.measures import static_options, zeroed_params
from pipeloom.tune.partition import partition_layers, partition_variants
from pipeloom.tune.pool import ROUND, RoundPool, default_jobs, fewer_collections
from pipeloom.tune.space import DEFAULT_SCHEMES, SCHEMES, Candidate, candidates
from pipeloom.tune.speed_noise import apply_speed_noise
from pipeloom.tune.topology import Split

__all__ = ["Evaluation", "TuneResult", "tune", "evaluate", "evaluate_schedule", "split_models"]

_EPS = 1e-9
_UNLIMITED = 2.0**80
"""Bytes of memory per device where none is set: finite, as budgeted schemes' bounds divide it."""
SLICED_OPS_LIMIT = 4_000
"""SVPP's list scheduler runs a dozen greedy passes in Python; beyond this many ops it is skipped."""
REFINED_PLANS = 3
"""The leading plans built again on other layer layouts (`_other_partitions`)."""


@fewer_collections()  # the whole search: it allocates millions of short-lived objects
def tune(
    cost_model: CostModel,
    devices: int,
    memory: float,
    global_batch: int,
    *,
    splits: Sequence[Split] | None = None,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    pp_values: Sequence[int] | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    keep: int = 10,
    memory_passes: bool = True,
    static_measures: bool = True,
    exhaustive: bool = False,
    progress: Callable[[int, int], None] | None = None,
    jobs: int | None = 1,
    layouts: bool = True,
    host_memory: float = math.inf,
    refuse: Callable[[Evaluation], str | None] | None = None,
) -> TuneResult:
    """The `keep` fastest plans that fit `memory` bytes per device; InfeasibleError if none does,
    naming the binding constraint. `memory_passes=False` leaves out Mario, T-Recomp and T-Offload;
    `static_measures=False` leaves out ZeRO-1/2 and offloading every stage's optimizer;
    `exhaustive` turns pruning off (for checking the pruning). `jobs` processes simulate
    candidates (None: every core this process may use); the result is the same for any.
    `splits`: how each stage's ranks may be cut (tp, cp, ep; `topology.splits`), each priced by
    the cost model for that split (`CostModel.with_split`) and searched in one ranking; default
    the cost model's own. `layouts`: the leading plans are also built on other layer layouts
    than the balanced one (`_other_partitions`). `host_memory`: bytes of host memory per device,
    which the optimizer state of offloaded stages must fit. `refuse`: what the runtime would
    refuse a plan for (None: nothing); a ranked plan it refuses is ruled out with that reason."""
    models = split_models(cost_model, splits if splits is not None else [cost_model.split])
    points = list(
        candidates(
            devices,
            global_batch,
            splits=list(models),
            schemes=schemes,
            pp_values=pp_values,
            micro_batches=micro_batches,
            num_layers=cost_model.model.layers,
        )
    )
    if not points:
        expert = any(split.ep > 1 for split in models)
        raise InfeasibleError(
            f"no configuration of {devices} devices divides the global batch {global_batch} "
            f"(dp × micro-batch size must divide it, the stages must not outnumber {cost_model.model.layers} layers"
            + (", and dp must be a multiple of ep)" if expert else ")")
        )
    prepared = [
        _prepare(point, models[point.split], memory, static_measures, host_memory=host_memory) for point in points
    ]
    prepared.sort(key=lambda item: item[1])
    rejected: list[Evaluation] = []
    evaluated = pruned = 0
    task = partial(simulate_task, memory=memory, memory_passes=memory_passes, host_memory=host_memory)
    with RoundPool(task, jobs if jobs is not None else default_jobs(), pack=packed) as pool:

        def rank(group: list) -> list[Evaluation]:
            """The `keep` fastest plans of `group` ((evaluation, bound), by bound), each
            candidate pruned against the plans of its own group."""
            nonlocal evaluated, pruned
            ranked: list[Evaluation] = []

            def threshold() -> float:
                return ranked[keep - 1].step_time if len(ranked) >= keep and not exhaustive else math.inf

            for first in range(0, len(group), ROUND):
                batch = list(enumerate(group[first : first + ROUND], first))
                limit = threshold()
                todo = [index for index, (evaluation, bound) in batch if not evaluation.reason and bound < limit - _EPS]
                sent = [group[index][0] for index in todo]
                sizes = [_ops(evaluation.candidate) for evaluation in sent]
                results = dict(zip(todo, pool.run(sent, limit, sizes)))
                evaluated += len(todo)
                for index, (evaluation, bound) in batch:
                    tick()
                    if index in results or not evaluation.reason:  # (a simulation may have set a reason)
                        if index not in results or bound >= threshold() - _EPS:
                            pruned += 1  # by the round's threshold, or by a plan found in this round
                            continue
                        evaluation, kept = results[index]
                        if not kept:
                            pruned += 1
                            continue
                    if evaluation.feasible:
                        split = evaluation.candidate.split
                        if split not in fastest or evaluation.step_time < fastest[split].step_time:
                            fastest[split] = evaluation
                        ranked.append(evaluation)
                        ranked.sort(key=lambda e: e.step_time)
                        del ranked[keep:]
                    else:
                        rejected.append(evaluation)
            return ranked

        done = 0

        def tick() -> None:
            nonlocal done
            done += 1
            if progress:
                progress(done, len(prepared))

        # Plans priced beyond what the profile measured (`extrapolations`) rank after the measured
        # ones and are pruned only against each other: a faster guess must not hide a measured plan.
        fastest: dict[Split, Evaluation] = {}

        guesses = [_guessed(models, evaluation, evaluation.partition) for evaluation, _ in prepared]
        measured = rank([item for item, guess in zip(prepared, guesses) if not guess])
        extrapolated = rank([item for item, guess in zip(prepared, guesses) if guess])
        ranked = (measured + extrapolated)[:keep]
        if ranked and layouts:
            evaluated += _other_partitions(ranked, pool, models, memory, static_measures, host_memory)
    for evaluation in ranked:
        restore(evaluation)
    reasons = {id(e): refuse(e) for e in ranked} if refuse is not None else {}
    refused = [replace(e, reason=f"refused by train: {reasons[id(e)]}") for e in ranked if reasons.get(id(e))]
    ranked = [e for e in ranked if not reasons.get(id(e))]
    rejected += refused
    if not ranked and refused:
        raise InfeasibleError(
            f"each of the {len(refused)} fastest plans that fit is {refused[0].reason.replace(': ', ' (', 1)})"
        )
    if not ranked:
        raise InfeasibleError(_binding_constraint(rejected, memory) + _host_note(rejected, host_memory))
    for evaluation in ranked:
        apply_speed_noise([evaluation], models[evaluation.candidate.split])
    ranked.sort(key=lambda evaluation: evaluation.step_time)
    leader = extrapolated[0] if extrapolated else None  # the fastest guess, for the note
    if leader is not None and all(leader is not e for e in ranked):
        restore(leader)
        apply_speed_noise([leader], models[leader.candidate.split])
    result = TuneResult(ranked, rejected, global_batch, memory, evaluated, pruned, host_memory)
    result.splits = _split_outcomes(models, prepared, fastest)
    model_of = _model_of(models)
    measured_first(result, model_of, leader)
    settle_near_ties(result, model_of)
    note_extrapolations(result, leader)
    return result


def split_models(cost_model: CostModel, splits: Sequence[Split]) -> dict[Split, CostModel]:
    """The cost model of each split: `cost_model` itself for its own (its caches stay warm)."""
    return {split: cost_model if split == cost_model.split else cost_model.with_split(split) for split in splits}


def _model_of(models: dict[Split, CostModel]) -> Callable[[Candidate], CostModel]:
    return lambda candidate: models[candidate.split]


def _split_outcomes(models: dict, prepared: list, fastest: dict[Split, Evaluation]) -> list[SplitOutcome]:
    """Per split searched, its fastest plan simulated, or else the least its plans' lower bounds
    allowed (all pruned, or none fits: inf); for `tune --explain`'s neighbours."""
    floors: dict[Split, float] = {}
    for evaluation, bound in prepared:
        split = evaluation.candidate.split
        floors[split] = min(floors.get(split, math.inf), bound)
    return [
        SplitOutcome(split, model, fastest.get(split), floors.get(split, math.inf)) for split, model in models.items()
    ]


def _other_partitions(
    ranked: list[Evaluation],
    pool: RoundPool,
    models: dict[Split, CostModel],
    memory: float,
    static_measures: bool,
    host_memory: float = math.inf,
) -> int:
    """The leading plans built and simulated again on other layer layouts (`partition_variants`):
    the layout is chosen with the schedule, the balanced one being one input, not the only one.
    A layout that makes a plan faster replaces it, and the ranking is sorted again — unless it
    holds stages of more or fewer layers than the profile measured where the plan's did not;
    and one within what was measured replaces a plan whose layout was not, faster or not (a
    measured plan ranks before every guess). Rebuilt, not re-timed: a budgeted generator's
    schedule for one layout's costs gains little on another's. How many were simulated."""
    leading = ranked[:REFINED_PLANS]
    sent: list[tuple[int, Evaluation, list]] = []
    limit = max(evaluation.step_time for evaluation in leading)
    for index, evaluation in enumerate(leading):
        base = replace(evaluation.candidate, passes=SCHEMES[evaluation.candidate.scheme].passes, zero=0)
        own = (evaluation.candidate.zero, "offload-all" in evaluation.candidate.passes)
        guessed = _guessed(models, evaluation, evaluation.partition)
        for layout in partition_variants(evaluation.partition):
            variant, bound = _prepare(base, models[base.split], memory, static_measures, layout, host_memory)
            every = variant.options  # the plan's own static measure only: a layer moves little memory
            variant.options = [option for option in every if (option.zero, option.offload_all) == own]
            measured_instead = guessed and not _guessed(models, evaluation, layout)
            if not variant.reason and variant.options and (measured_instead or bound < evaluation.step_time - _EPS):
                sent.append((index, variant, every))
                limit = math.inf if measured_instead else limit
    results = pool.run([variant for _, variant, _ in sent], limit, [_ops(variant.candidate) for _, variant, _ in sent])
    for (index, _, every), (variant, _) in zip(sent, results):
        plan = ranked[index]
        if variant.feasible and (
            (_guessed(models, variant, variant.partition), variant.step_time)
            < (_guessed(models, plan, plan.partition), plan.step_time - _EPS)
        ):
            variant.options = every  # what --explain weighs the measure against
            ranked[index] = variant
    ranked.sort(key=lambda e: e.step_time)
    return len(sent)


def _guessed(models: dict[Split, CostModel], evaluation: Evaluation, layout: Sequence[int]) -> bool:
    """Whether `evaluation`'s plan on `layout` (layers per stage) is priced beyond what the profile
    measured (`extrapolations`)."""
    candidate = evaluation.candidate
    return bool(models[candidate.split].extrapolations(candidate.micro_batch, candidate.slices, layout))


def evaluate(
    candidate: Candidate,
    cost_model: CostModel,
    memory: float,
    memory_passes: bool = True,
    static_measures: bool = True,
    host_memory: float = math.inf,
) -> Evaluation:
    """One candidate, fully (no pruning), priced for its split."""
    cost_model = split_models(cost_model, [candidate.split])[candidate.split]
    evaluation, _ = _prepare(candidate, cost_model, memory, static_measures, host_memory=host_memory)
    if not evaluation.reason:
        simulate_candidate(evaluation, memory, memory_passes=memory_passes, host_memory=host_memory)
    return evaluation


def evaluate_schedule(candidate: Candidate, cost_model: CostModel, partition: list[int], schedule) -> Evaluation:
    """A schedule already built for `candidate` on `partition`, timed under `cost_model` with
    the static measure `candidate.zero` and its passes name (no search, no memory limit): what
    a plan takes on the machine as another profile found it. ConfigError if the cost model
    prices no such measure for it."""
    cost_model = split_models(cost_model, [candidate.split])[candidate.split]
    evaluation, _ = _prepare(candidate, cost_model, _UNLIMITED, partition=partition)
    option = evaluation.static_option
    if evaluation.reason or option is None:
        raise ConfigError(f"plan {candidate.label}: {evaluation.reason or 'its static measure is not priced here'}")
    record_timing(evaluation, option, schedule, offload_lanes(schedule, option.costs, candidate.passes))
    evaluation.feasible = True
    apply_speed_noise([evaluation], cost_model)
    return evaluation


def _prepare(
    candidate: Candidate,
    cost_model: CostModel,
    memory: float,
    static_measures: bool = True,
    partition: list[int] | None = None,
    host_memory: float = math.inf,
) -> tuple[Evaluation, float]:
    """Partition (the balanced one unless given), the static-memory measures that fit (the
    device's memory and, for what they offload, the host's), and a lower bound on the step time."""
    evaluation = Evaluation(candidate)
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
    evaluation.overhead_time = cost_model.step_overhead_time(zeroed_params(candidate, cost_model, evaluation.partition))
    every = static_options(candidate, cost_model, evaluation.partition, static_measures)
    host_needs = [max(option.host_memory, default=0.0) for option in every]
    options = [option for option, need in zip(every, host_needs) if need <= host_memory + _EPS]
    evaluation.host_short = min((need for need in host_needs if need > host_memory + _EPS), default=0.0)
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
            f"memory: static {byte_size(worst, 2)} on device {device} exceeds {byte_size(memory, 2)} before any activation"
            + (f", even with {least.label}" if len(options) > 1 else "")
        )
        return evaluation, math.inf
    extra = min(option.sync_floor + option.optimizer_time for option in fitting)
    floor = pipeline_floor(candidate, plain.costs)
    if SCHEMES[candidate.scheme].budgeted:  # no pass trades its activations for time
        floor = max(floor, room_floor(candidate, plain.costs, most_room(fitting, memory)))
    return evaluation, floor + extra + evaluation.overhead_time


def _ops(candidate: Candidate) -> int:
    """How many ops its schedule has: a guess at how long it takes to build and simulate."""
    return 2 * candidate.num_stages * candidate.num_microbatches * candidate.slices


def _host_note(rejected: list[Evaluation], host_memory: float) -> str:
    """What the host's limit ruled out, when it did: offloading that would have needed more."""
    needs = [e.host_short for e in rejected if e.host_short]
    if not needs:
        return ""
    return (
        f"; offloading optimizer state to the host would need at least {byte_size(min(needs), 2)} of host memory per "
        f"device, over the {byte_size(host_memory, 2)} there is (--host-memory)"
    )


def _binding_constraint(rejected: list[Evaluation], memory: float) -> str:
    """The constraint that ruled out the configuration closest to fitting."""
    measured = [e for e in rejected if e.peak_memory or e.static_memory]
    if measured:
        closest = min(measured, key=lambda e: max(e.peak_memory or e.static_memory))
        need = max(closest.peak_memory or closest.static_memory)
        return (
            f"no plan fits {byte_size(memory, 2)} per device: the least any configuration needs is {byte_size(need, 2)} "
            f"({closest.candidate.label}; {closest.reason})"
        )
    reasons = sorted({e.reason.split(":")[0] for e in rejected})
    return f"no plan fits: every configuration was ruled out ({', '.join(reasons)}); e.g. {rejected[0].reason}"
