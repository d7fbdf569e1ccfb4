"""The static-memory measures a tuner candidate can take — ZeRO-0/1/2 and every stage's
optimizer on the host (`pipeloom.static_memory`) — each with its costs, static bytes per
device and what it adds to a step."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from functools import lru_cache

from pipeloom.costs import Costs, hosts_both_ends
from pipeloom.tune.cost_model import CostModel
from pipeloom.tune.space import Candidate

__all__ = ["StaticOption", "static_options", "zeroed_params"]


@dataclass(frozen=True)
class StaticOption:
    """One static-memory measure for a candidate: its costs, static bytes per device (after any
    offload) and what it adds to a step."""

    zero: int
    offload_all: bool
    costs: Costs
    static_memory: list[float]
    allreduce_time: float
    optimizer_time: float
    replica_skew: float = 0.0
    """Share of the pipeline's time the gradient collectives also wait for the slowest of the dp
    replicas (the cost model's, measured; 0 where it has none)."""
    host_memory: tuple[float, ...] = ()
    """Per device, the host memory its offloaded stages take (empty: nothing on the host)."""
    stage_sync: tuple[float, ...] = ()
    """Per stage, its gradients' sum over the replicas (ZeRO-0's all-reduce, ZeRO-1's reduce-
    scatter), which the runtime starts as the stage's last backward ends
    (`pipeloom.sim.grad_sync`): the step pays what the pipeline does not hide, and of what it
    hides the share `sync_contention`. Empty: the sync runs after the pipeline
    (`allreduce_time`: ZeRO-2's)."""
    sync_contention: float = 0.0
    """The share of a hidden sync's time the ops beside it lose (`CostModel.sync_contention`)."""
    tp_sum: float = 0.0
    """Sequence parallelism's sum over the busiest device's tp ranks, after the replicas' sync
    (`CostModel.tp_sum_time`)."""

    @property
    def sync_floor(self) -> float:
        """The least the gradient sync can add to the step: a training schedule's last op is a
        backward, whose stage's all-reduce starts only then (the sequential time, unoverlapped);
        of the rest, hidden, the ops lose their share; sequence parallelism's sum follows it."""
        if not self.stage_sync:
            return self.allreduce_time + self.tp_sum
        least = min(self.stage_sync)
        hidden_share = self.sync_contention * max(0.0, self.allreduce_time - least)
        return least + hidden_share + self.tp_sum

    @property
    def label(self) -> str:
        return "offload of every stage's optimizer" if self.offload_all else f"ZeRO-{self.zero}"


def static_options(
    candidate: Candidate, cost_model: CostModel, partition: list[int], static_measures: bool
) -> list[StaticOption]:
    """ZeRO-0, then (if allowed) ZeRO-1 and ZeRO-2 where dp shards something, then every stage's
    optimizer on the host where the cost model prices the host link."""
    placement = candidate.placement
    params, experts = cost_model.stage_params(partition), cost_model.expert_params(partition)
    on_device = max(_held(cost_model, params, stages_on) for stages_on in placement)
    replicas = candidate.dp * candidate.replicas  # Chimera, DualPipe: two copies per pipeline
    levels = [0] + ([1, 2] if static_measures and candidate.dp > 1 else [])
    layers = (sum(partition[s] for s in stages_on) for stages_on in placement)
    tp_sum = max(cost_model.tp_sum_time(n, candidate.micro_batch) for n in layers)
    options = []
    for zero in levels:
        costs = _stage_costs(
            cost_model, tuple(partition), candidate.micro_batch, candidate.pp, candidate.dp, zero, candidate.slices
        )
        # the runtime all-gathers ZeRO-1/2's new weights after the optimizer step: priced in that phase
        gather = cost_model.gather_time(on_device, candidate.pp, replicas) if zero else 0.0
        sequential, per_stage = _gradient_sync(cost_model, candidate, params, experts, replicas, zero)
        options.append(
            StaticOption(
                zero,
                False,
                costs,
                [_static_on(costs, stages_on, candidate.num_stages) for stages_on in placement],
                sequential - gather,
                cost_model.optimizer_time(on_device, candidate.dp, zero=zero) + gather,
                # only the dp replicas, each a pipeline of its own, drift apart; the copies within
                # one pipeline (Chimera's, DualPipe's) end where the simulated timeline has them
                cost_model.replica_skew(candidate.dp, zero=zero),
                # ZeRO-0's all-reduce and ZeRO-1's reduce-scatter start as a stage's last backward
                # ends; ZeRO-2's (bf16 into the fp32 shard, in pieces) after the pipeline
                stage_sync=tuple(
                    time - (cost_model.gather_time(params[s], candidate.pp, replicas) if zero else 0.0)
                    for s, time in enumerate(per_stage)
                )
                if zero < 2 and replicas > 1
                else (),
                sync_contention=cost_model.sync_contention,
                tp_sum=tp_sum,
            )
        )
    plain = options[0]
    saved = [plain.costs.stage_value("M_offload", s) for s in range(candidate.num_stages)]
    if static_measures and any(value > 0 for value in saved):
        options.append(
            StaticOption(
                0,
                True,
                plain.costs,
                [_static_on(plain.costs, stages_on, candidate.num_stages, saved) for stages_on in placement],
                plain.allreduce_time,
                0.0,  # the host steps every stage, in the offload lanes
                plain.replica_skew,
                tuple(sum(plain.costs.stage_value("M_host", s) for s in stages_on) for stages_on in placement),
                plain.stage_sync,
                plain.sync_contention,
                plain.tp_sum,
            )
        )
    return options


@lru_cache(maxsize=2048)
def _stage_costs(
    cost_model: CostModel, partition: tuple[int, ...], micro_batch: int, pp: int, dp: int, zero: int, slices: int
) -> Costs:
    """Cached: the schemes with as many stages share them, and building (and checking) Costs
    was most of what the tuner spent before simulating anything."""
    return cost_model.stage_costs(list(partition), micro_batch, pp, dp, zero=zero, slices=slices)


def _gradient_sync(
    cost_model: CostModel, candidate: Candidate, params: list[float], experts: list[float], replicas: int, zero: int
) -> tuple[float, tuple[float, ...]]:
    """The gradients' collectives: (the busiest device's, all after the pipeline; each stage's
    own, as the runtime overlaps them). Over every replica, but a routed expert's over only the
    replicas that hold the same experts (replicas / EP; none at dp = EP)."""
    copies = replicas // cost_model.model.expert_parallel

    def sync(stages: list[int]) -> float:
        shared, local = _synced(cost_model, params, experts, stages)
        time = cost_model.allreduce_time(shared, candidate.pp, replicas, zero=zero)
        return time + (cost_model.allreduce_time(local, candidate.pp, copies, zero=zero) if local else 0.0)

    per_stage = tuple(sync([s]) for s in range(len(params)))
    return max(sync(list(stages_on)) for stages_on in candidate.placement), per_stage


def zeroed_params(candidate: Candidate, cost_model: CostModel, partition: list[int]) -> float:
    """The parameters whose gradients the busiest device's buffers hold for its replicas (the dp
    replicas, Chimera's copies, the cp ranks that hold the same weights) to sum in place, zeroed
    at each step's start: none without replicas; a routed expert's only where other replicas
    hold the same experts."""
    replicas = candidate.dp * candidate.replicas * cost_model.split.cp
    if replicas == 1:
        return 0.0
    params, experts = cost_model.stage_params(partition), cost_model.expert_params(partition)
    copies = replicas // cost_model.model.expert_parallel
    held = (_synced(cost_model, params, experts, stages) for stages in candidate.placement)
    return max(shared + (local if copies > 1 else 0.0) for shared, local in held)


def _synced(
    cost_model: CostModel, params: list[float], experts: list[float], stages: Collection[int]
) -> tuple[float, float]:
    """A device's parameters summed over every replica, and its routed experts' summed over only
    the replicas that hold the same experts (none under EP 1: they sum with the rest)."""
    local = sum(experts[s] for s in stages) if cost_model.model.expert_parallel > 1 else 0.0
    return _held(cost_model, params, stages) - local, local


def _static_on(costs: Costs, stages: Collection[int], num_stages: int, offloaded: Sequence[float] = ()) -> float:
    """A device's static bytes: its stages', less what each offloads to the host, a tie both
    ends count held once (`Costs.shared_static`)."""
    held = sum(costs.stage_value("M_static", s) - (offloaded[s] if offloaded else 0.0) for s in stages)
    return held - costs.shared_static(stages, num_stages)


def _held(cost_model: CostModel, params: list[float], stages: Collection[int]) -> float:
    """Parameters of one rank on a device hosting `stages`: a tie both ends count, once."""
    tied = cost_model.tied_params() if hosts_both_ends(stages, len(params)) else 0.0
    return sum(params[s] for s in stages) - tied
