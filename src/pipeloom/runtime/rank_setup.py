"""The pieces `rank.RankRun.set_up` assembles, each from the part of the spec it needs: the
transport, the hosted stages (split for W, cut over their tensor-parallel group), the optimizers,
the mailbox and the optimizer sync — and which device counts a parameter in the global norm.
Every rank calls them in the same order, since several make process groups."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.ir.ops import OpKind
from pipeloom.models.context_parallel import ContextShard
from pipeloom.models.workload import Workload
from pipeloom.runtime.boundary import StageProbe, TensorSpec
from pipeloom.runtime.comm import MessagePlan
from pipeloom.runtime.expert_parallel import ExpertExchange
from pipeloom.runtime.gradients import unique_parameters
from pipeloom.runtime.mailbox import Mail, Mailbox
from pipeloom.runtime.memory_mailbox import MemoryMailbox, Postbox
from pipeloom.runtime.offload import HostOffload
from pipeloom.runtime.optimizer_sync import OptimizerSync
from pipeloom.runtime.placement import WeightPlacements
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.spec import OptimizerPart, ParallelPart, RankResult, TrainSpec
from pipeloom.runtime.split_linear import WeightGradQueue, split_linears
from pipeloom.runtime.tensor_parallel import TensorParallel, parallel_loss, wire_boundaries
from pipeloom.runtime.tensor_parallel_styles import shard_stages
from pipeloom.runtime.zero import JointSteppers, ReplicatedAdamW, ShardedAdamW, squares_and_bad

__all__ = [
    "Transport",
    "torch_device_of",
    "hosted_stages",
    "cut_stages",
    "context_share",
    "steppers",
    "mailbox_of",
    "progress_of",
    "optimizer_sync",
    "leaves_of",
    "zero_overlap",
]


@dataclass(frozen=True)
class Transport:
    """How a rank talks to the others: process groups and messages over torch.distributed, or
    (`postbox` set) every device in this process, messages in memory and no process groups."""

    world_size: int
    postbox: Postbox | None = None

    @property
    def distributed(self) -> bool:
        return self.postbox is None

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup | None:
        return dist.new_group(ranks) if self.distributed else None


def torch_device_of(spec: TrainSpec) -> torch.device:
    if spec.torch_device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def hosted_stages(schedule, all_stages, device: int, where: torch.device) -> tuple[dict, WeightGradQueue]:
    """This device's stages, their linears split for W when its ops have W (fused backwards keep
    plain linears): on its torch device, or still on the meta device for `materialise` to place
    once they are cut."""
    queue = WeightGradQueue()
    stages = {
        s: all_stages[s] if any(t.is_meta for t in all_stages[s].parameters()) else all_stages[s].to(where)
        for s in schedule.stages_on(device)
    }
    if any(op.kind is OpKind.W for op in schedule.devices[device]):
        for module in stages.values():
            split_linears(module, queue)
    return stages, queue


def cut_stages(parallel: ParallelPart, work: Workload, tensor: TensorParallel, stages, buckets, group, probe):
    """This rank's stages cut over its tensor-parallel group (`group`, the ranks of the mesh's tp
    dimension): the buckets then sum shards (and, under sequence parallelism, the replicated
    weights' partial gradients over the group); what crosses a boundary is a sequence shard; the
    loss runs over the vocabulary shards. Returns (the probe as this rank sees it, the loss)."""
    assert work.tensor_parallel is not None, "check_spec refuses a model without a plan"
    plan = work.tensor_parallel(parallel.tp, parallel.sequence_parallel)
    partial = shard_stages(stages, plan, tensor, parallel.schedule.num_stages)
    tensor.partial = {id(parameter) for parameter in partial}
    buckets.rebind(tensor.shards)
    buckets.sum_over(tensor.mesh.get_group(), group, partial)
    wire = StageProbe(wire_boundaries(probe.boundaries, parallel.tp), [f / parallel.tp for f in probe.forward_flops])
    return wire, parallel_loss(work.loss)


def context_share(
    parallel: ParallelPart, work: Workload, stages: dict, probe: StageProbe, replica: int, where: torch.device
) -> tuple[ContextShard, StageProbe]:
    """This rank's share of every sequence over its context-parallel group (the mesh's cp
    dimension), given to each of its stages; what enters and leaves a stage (the data included)
    is that share. Returns (the share, the probe as this rank sees it)."""
    assert work.context_parallel is not None, "check_spec refuses a model that cannot split its sequence"
    layout = parallel.layout
    mesh = layout.context_mesh(where.type)["cp"]
    shard = ContextShard(parallel.cp, layout.samples_of(replica)[1], work.sample_tokens, mesh)
    for stage in stages.values():
        work.context_parallel(stage, shard)

    def share(spec: TensorSpec) -> TensorSpec:
        if len(spec.shape) < 2:
            return spec
        return TensorSpec((spec.shape[0], spec.shape[1] // parallel.cp, *spec.shape[2:]), spec.dtype)

    boundaries = [tuple(share(spec) for spec in specs) for specs in probe.boundaries]
    forward = [flops / parallel.cp for flops in probe.forward_flops]  # attention's too: head-tail balanced
    return shard, StageProbe(boundaries, forward, [held / parallel.cp for held in probe.stash_bytes])


def steppers(
    parallel: ParallelPart,
    optimizer: OptimizerPart,
    placements: WeightPlacements,
    stages: dict,
    device: int,
    tp_index: int,
    precision: Precision,
    groups: dict[str, dist.ProcessGroup | None],
    ep_index: int = 0,
) -> tuple[HostOffload | None, ReplicatedAdamW | ShardedAdamW | JointSteppers, list]:
    """(the host's optimizer for offloaded stages, the device's optimizer, the parameters it
    steps), each weight where its placement's `optimizer` says: on every replica, ZeRO-sharded
    over `groups["dp"]` (the mesh's data-parallel group of this rank) or, an expert slice, over
    `groups["edp"]` (the replicas holding the same experts), or on the host."""
    offloaded = [s for s in stages if s in parallel.offload_stages]
    held = unique_parameters(list(stages.values()))
    host = None
    if offloaded:
        routed = {id(t) for t in held if placements[t].optimizer == "host" and placements.expert(t)}
        sums = (groups["dp"], groups["edp"]) if parallel.zero else (None, None)  # else the buckets sum
        host = HostOffload(
            stages,
            offloaded,
            optimizer.lr,
            parallel.reload_bits,
            precision.dtype,
            placements.counted,
            sums[0],
            (routed, sums[1]),
        )
    parameters = [t for t in held if placements[t].optimizer != "host"]
    if not parallel.zero:
        return host, ReplicatedAdamW(parameters, placements.counted, optimizer.lr), parameters
    label = f"device{device}" + (f".tp{tp_index}" if parallel.tp > 1 else "")
    parts = []
    for where, suffix in (("dp", ""), ("edp", f".ep{ep_index}")):
        group, chosen = groups[where], [t for t in parameters if placements[t].optimizer == where]
        if chosen or where == "dp":
            assert group is not None, "ZeRO shards over torch.distributed; in-process runs refuse it"
            parts.append(
                ShardedAdamW(
                    chosen, placements.counted, optimizer.lr, parallel.zero, group, precision.dtype, label + suffix
                )
            )
    return host, parts[0] if len(parts) == 1 else JointSteppers(*parts), parameters


def leaves_of(stepper) -> list:
    """The optimizers a stepper is made of (one, or a joint's)."""
    return stepper.leaves() if isinstance(stepper, JointSteppers) else [stepper]


def zero_overlap(stepper, stages: dict, buckets) -> Callable[[Sequence[int]], list[int]] | None:
    """ZeRO-1's sums over the replicas, each stage's started as its last backward ends (None:
    not ZeRO-1). A stage holding a weight that a bucket also sums (a tie across the pipeline)
    waits for the pipeline, since that bucket's sum must come first."""
    sharded = [part for part in leaves_of(stepper) if isinstance(part, ShardedAdamW) and part.level == 1]
    if not sharded:
        return None
    bucketed = {id(p) for bucket in buckets.buckets for p in bucket.parameters}
    stage_of: dict[int, int] = {}
    for stage, module in stages.items():
        for parameter in module.parameters():
            stage_of.setdefault(id(parameter), stage)
    for part in sharded:
        ranges: dict[int, tuple[int, int]] = {}
        offset = 0
        for parameter in part.parameters:
            stage = stage_of[id(parameter)]
            low, _ = ranges.get(stage, (offset, offset))
            ranges[stage] = (low, offset + parameter.numel())
            offset += parameter.numel()
        tied = {stage_of[id(p)] for p in part.parameters if id(p) in bucketed}
        part.overlap(ranges, set(ranges) - tied)

    def start(stages: Sequence[int]) -> list[int]:
        return sorted({stage for part in sharded for stage in part.start(stages)})

    return start


def mailbox_of(
    parallel: ParallelPart,
    transport: Transport,
    plan: MessagePlan,
    device: int,
    replica: int,
    tp_index: int,
    probe: StageProbe,
    where: torch.device,
) -> Mail:
    if transport.postbox is not None:
        return MemoryMailbox(plan, device, probe.boundaries, transport.postbox)
    layout = parallel.layout
    # One group per ordered pair of devices: each carries one direction only, so posting its
    # receives ahead in the sender's order can never block a send the other way (NCCL runs a
    # pair's operations in order on one stream). Tensor-parallel rank t talks to rank t of the
    # next stage. Every rank creates every replica's and tensor-parallel index's groups.
    pairs = sorted({(m.src, m.dst) for sends in plan.sends for m in sends})
    groups = {
        (r, t): {(a, b): dist.new_group([layout.rank(r, a, t), layout.rank(r, b, t)]) for a, b in pairs}
        for r in range(parallel.replicas)
        for t in range(parallel.tp)
    }
    return Mailbox(
        plan,
        device,
        probe.boundaries,
        lambda d: layout.rank(replica, d, tp_index),
        groups[(replica, tp_index)],
        where,
        timedelta(seconds=parallel.timeout_s),
    )


def progress_of(spec: TrainSpec, rank: int, result: RankResult):
    if not spec.report or rank != 0:
        return None
    from pipeloom.runtime.metrics import StepReporter

    return StepReporter(result, spec.steps, spec.peak_tflops)


def optimizer_sync(
    optimizer: OptimizerPart,
    parallel: ParallelPart,
    stepper,
    device: int,
    replica: int,
    scaler,
    tensor: TensorParallel | None = None,
    experts: ExpertExchange | None = None,
    placements: WeightPlacements | None = None,
):
    """Global clipping / skipping (also fp16's overflow skip), if asked for, over every rank of
    this replica — its pipeline devices and their tensor-parallel groups; its process groups are
    made on every rank alike."""
    if not optimizer.needs_global_state:
        return None
    p, tp, layout = parallel.schedule.num_devices, parallel.tp, parallel.layout
    groups = [
        dist.new_group([layout.rank(r, d, t) for d in range(p) for t in range(tp)]) for r in range(parallel.replicas)
    ]
    tp_index = tensor.index if tensor is not None else 0
    local_state = None
    if experts is not None:
        assert placements is not None, "expert slices are found by their placements"
        local_state = _with_experts(stepper, experts, placements)
    return OptimizerSync(
        stepper,
        optimizer.clip_norm,
        optimizer.post_validation,
        device,
        p,
        lambda d: layout.rank(replica, d, tp_index),
        groups[replica],
        parallel.timeout_s,
        on_decision=scaler.update if scaler is not None else None,
        tensor_group=tensor.mesh.get_group() if tensor is not None else None,
        local_state=local_state,
    )


def _with_experts(stepper, experts: ExpertExchange, placements: WeightPlacements) -> Callable[[], torch.Tensor]:
    """A rank's state under expert parallelism: its dense weights as any rank's (equal on every
    replica, so counted within one), plus its expert slices' summed over the expert-parallel
    group — whose ranks hold the layer's experts between them, each once. A ZeRO optimizer of
    expert slices alone sums its shards over their replicas first."""
    parts = leaves_of(stepper)
    device = next((t.device for part in parts for t in _held(part)), torch.device("cpu"))
    of_experts = {
        id(part)
        for part in parts
        if isinstance(part, ShardedAdamW) and part.parameters and all(placements.expert(p) for p in part.parameters)
    }

    def local_state() -> torch.Tensor:
        dense = torch.zeros(2, dtype=torch.float64, device=device)
        shared = torch.zeros_like(dense)
        for part in parts:
            if isinstance(part, ShardedAdamW):
                if id(part) in of_experts:
                    shared += part.local_state()
                else:
                    dense += part.local_state()
                continue
            owned = part.owned_gradients()
            dense += squares_and_bad([g for p, g in owned if not placements.expert(p)], device)
            shared += squares_and_bad([g for p, g in owned if placements.expert(p)], device)
        dist.all_reduce(shared, group=experts.group)
        return dense + shared

    return local_state


def _held(part) -> list:
    return part.parameters if isinstance(part, ReplicatedAdamW | ShardedAdamW) else part.store.parameters
