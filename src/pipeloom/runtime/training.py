"""Training with a pipeline schedule on a pp × dp grid of processes, and its single-process reference.

Rank r is device r mod p of data-parallel replica r // p. Every rank builds the full model from
the seed and keeps the stages its device hosts, so all replicas start identical. A step feeds
replica k the micro-batches k·m .. k·m+m−1 of the step's batch, runs the device's op list, sums
each stage's gradients over every copy of it (its data-parallel replicas and, in Chimera, its
second pipeline's copy), then steps AdamW. `reference_training` runs the same model on the same
data in one process — what every schedule must reproduce.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.errors import ConfigError, RuntimeFault
from pipeloom.ir.ops import OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.validate import validate
from pipeloom.models.llama import LlamaConfig, stage_layer_counts
from pipeloom.runtime.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.executor import DeviceExecutor, StepRecord, peer_failure
from pipeloom.runtime.offload import HostOffload
from pipeloom.runtime.optimizer_sync import OptimizerSync
from pipeloom.runtime.split_linear import WeightGradQueue, split_linears
from pipeloom.runtime.workload import Workload, llama_workload

__all__ = ["TrainSpec", "check_spec", "train_rank", "reference_training", "RankResult"]


@dataclass(frozen=True)
class TrainSpec:
    schedule: Schedule
    config: LlamaConfig = LlamaConfig()
    dp: int = 1
    steps: int = 2
    seed: int = 0
    lr: float = 1e-3
    layer_counts: tuple[int, ...] | None = None
    concat_w: bool = False
    threads: int = 1
    timeout_s: float = 60.0
    report: bool = False
    """Rank 0 prints each step's loss and time."""
    backend: str = "gloo"
    """gloo (CPU) or nccl (one GPU per rank, LOCAL_RANK picks it)."""
    workload: Workload | None = None
    """Any model, data and loss; None: the LLaMA-style decoder of `config`."""
    offload_stages: tuple[int, ...] = ()
    """T-Offload: these stages' optimizer runs on the host (`runtime.offload`)."""
    reload_bits: int = 32
    """Weights come back exactly (32) or rounded through bfloat16 (16)."""
    clip_norm: float | None = None
    """Clip gradients to this global norm (over every stage); a step with NaN/Inf gradients is
    skipped whenever clipping or post-validation is on."""
    post_validation: bool = False
    """Step under a partially reduced state and validate afterwards (Zero Bubble §4) instead of
    all-reducing it first."""
    gradient_faults: tuple[tuple[int, int, str, float], ...] = ()
    """For tests of the above: (step, stage, "nan" or "scale", factor) applied to that stage's
    gradients after they are reduced."""
    save_every: int = 0
    """Write a checkpoint every this many steps into `save_dir` (0: never)."""
    save_dir: str | None = None
    resume_dir: str | None = None
    """Continue from a checkpoint (a step-N directory, or the newest in this directory) up to `steps`."""

    def resolved_workload(self) -> Workload:
        return self.workload or llama_workload(self.config, self.seed, self.layer_counts)


@dataclass
class RankResult:
    rank: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    parameters: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Stage → its parameters after the last step (this rank's copy)."""
    rollbacks: int = 0
    """Optimizer steps post-validation rolled back and redone."""
    skipped_steps: int = 0
    offload_events: list[tuple[str, float, float]] = field(default_factory=list)
    """T-Offload's OFFLOAD, HOST_STEP and RELOAD on this rank (perf_counter seconds)."""
    all_results: list | None = None
    """On rank 0 of a gathered run: every rank's result."""


def check_spec(spec: TrainSpec, world_size: int | None = None) -> None:
    """Refuse before any compute: invalid schedule, wrong world size, uncuttable layers."""
    validate(spec.schedule)
    slices = spec.schedule.num_slices
    if slices > 1 and spec.workload is not None:
        raise ConfigError("train: slices need the LLaMA-style decoder (its attention reads earlier slices' keys)")
    if slices > 1 and spec.config.seq_len % slices:
        raise ConfigError(f"train: sequence length {spec.config.seq_len} does not split into {slices} equal slices")
    if spec.dp < 1:
        raise ConfigError(f"train: data-parallel size must be at least 1, got {spec.dp}")
    if spec.backend not in ("gloo", "nccl"):
        raise ConfigError(f"train: backend must be gloo or nccl, got {spec.backend!r}")
    if spec.backend == "nccl" and not torch.cuda.is_available():
        raise ConfigError("train: the nccl backend needs CUDA GPUs; use gloo on CPU")
    expected = spec.schedule.num_devices * spec.dp
    if world_size is not None and world_size != expected:
        raise ConfigError(
            f"train: world size {world_size} does not match p × dp = {spec.schedule.num_devices} × {spec.dp} = {expected}"
        )
    if spec.workload is None:
        stage_layer_counts(spec.config, spec.schedule.num_stages, spec.layer_counts)
    bad = sorted(set(spec.offload_stages) - set(range(spec.schedule.num_stages)))
    if bad or spec.reload_bits not in (16, 32):
        raise ConfigError(
            f"train: offload stages must be among the schedule's and reload bits 16 or 32 (got {bad}, {spec.reload_bits})"
        )
    if spec.offload_stages and (spec.clip_norm is not None or spec.post_validation):
        raise ConfigError("train: clipping and post-validation do not cover host-stepped (offloaded) stages yet")
    if spec.clip_norm is not None and spec.clip_norm <= 0:
        raise ConfigError(f"train: the clipping norm must be positive, got {spec.clip_norm}")
    if spec.offload_stages and (spec.save_every or spec.resume_dir):
        raise ConfigError(
            "train: checkpoints do not carry host-side optimizer state yet; drop --save/--resume or offload"
        )
    if (spec.save_dir is None) != (spec.save_every == 0) or spec.save_every < 0:
        raise ConfigError("train: checkpoints need both a directory (--save) and a period (--save-every >= 1)")
    if spec.resume_dir is not None:
        _, done = find_checkpoint(spec.resume_dir, expected, spec.schedule.name)
        if done >= spec.steps:
            raise ConfigError(f"train: the checkpoint is already {done} steps in; ask for more than {done} --steps")


def train_rank(spec: TrainSpec, rank: int, world_size: int, init_method: str, gather: bool = False) -> RankResult:
    """Run `spec` as one rank of the process group; ranks return their own results, and with
    `gather` rank 0's result also carries every rank's (`all_results`)."""
    check_spec(spec, world_size)
    torch.set_num_threads(spec.threads)
    if spec.backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    dist.init_process_group(
        spec.backend,
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    try:
        result = _train(spec, rank)
        if gather:
            collected = [None] * world_size if rank == 0 else None
            dist.gather_object(result, collected, dst=0)
            result.all_results = collected
        return result
    except RuntimeError as error:  # a peer died or stalled: one clear line on every rank
        raise RuntimeFault(f"rank {rank}: {peer_failure(error)}") from None
    finally:
        dist.destroy_process_group()


def _train(spec: TrainSpec, rank: int) -> RankResult:
    schedule, work = spec.schedule, spec.resolved_workload()
    p = schedule.num_devices
    replica, device = divmod(rank, p)
    where = torch.device("cuda", torch.cuda.current_device()) if spec.backend == "nccl" else torch.device("cpu")
    all_stages = work.build(schedule.num_stages)
    hosted = schedule.stages_on(device)
    queue = WeightGradQueue()
    stages = {s: all_stages[s].to(where) for s in hosted}
    if any(op.kind is OpKind.W for op in schedule.devices[device]):  # fused backwards keep plain linears
        for module in stages.values():
            split_linears(module, queue)
    offloaded = [s for s in hosted if s in spec.offload_stages]
    host = HostOffload(stages, offloaded, spec.lr, spec.reload_bits) if offloaded else None
    parameters = [p_ for s in hosted if s not in offloaded for p_ in stages[s].parameters()]
    every_parameter = [p_ for s in hosted for p_ in stages[s].parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=spec.lr) if parameters else None
    groups = _gradient_groups(schedule, spec.dp)
    plan = plan_messages(schedule)
    pair_groups = _pair_groups(plan, spec.dp, p)[replica]
    executor = DeviceExecutor(
        schedule,
        plan,
        device,
        stages,
        queue,
        rank_of=lambda d: replica * p + d,
        activation_shape=work.activation_shape,
        loss=work.loss,
        loss_scale=1.0 / (schedule.num_microbatches * spec.dp * schedule.num_slices),
        concat_w=spec.concat_w,
        pair_groups=pair_groups,
        device_type=where,
        timeout_s=spec.timeout_s,
        before_forward=host.reload if host else None,
    )
    sync = _optimizer_sync(spec, optimizer, stages, device, replica)
    result = RankResult(rank)
    m, b = schedule.num_microbatches, work.microbatch_size
    first = 0
    if spec.resume_dir is not None:
        path, _ = find_checkpoint(spec.resume_dir, dist.get_world_size(), schedule.name)
        first = load_checkpoint(path, stages, optimizer)
    for step in range(first, spec.steps):
        began = time.perf_counter()
        tokens, targets = work.batch(spec.dp * m * b, step)
        tokens, targets = tokens.to(where), targets.to(where)
        rows = [slice((replica * m + j) * b, (replica * m + j + 1) * b) for j in range(m)]
        if sync is not None:
            sync.validate()  # the previous step, against the full state the last device sent back
        for parameter in every_parameter:
            parameter.grad = None
        record = executor.run_step([tokens[r] for r in rows], [targets[r] for r in rows])
        for stage in hosted:
            group, ranks = groups[stage]
            _collective(
                rank,
                f"the all-reduce of stage {stage}'s gradients with ranks {ranks}",
                _reduce_gradients,
                stages[stage],
                group,
            )
        _inject_faults(spec, step, stages)
        if host is not None:
            host.offload_and_step()  # the host steps these stages while this rank goes on
        if sync is not None:
            sync.step(step)
        elif optimizer is not None:
            optimizer.step()
        loss = torch.tensor([record.loss], dtype=torch.float64, device=where)
        _collective(
            rank, f"the all-reduce of the loss with ranks {list(range(dist.get_world_size()))}", dist.all_reduce, loss
        )
        result.losses.append(float(loss))
        result.step_seconds.append(time.perf_counter() - began)
        result.records.append(record)
        if spec.report and rank == 0:
            print(f"step {step}: loss {result.losses[-1]:.6f}  time {result.step_seconds[-1] * 1e3:.1f} ms", flush=True)
        if spec.save_every and (step + 1) % spec.save_every == 0:
            if sync is not None:
                sync.validate()
            save_checkpoint(spec.save_dir, step + 1, stages, optimizer, schedule.name)
    if sync is not None:
        sync.validate()
        result.rollbacks, result.skipped_steps = sync.rollbacks, sync.skipped
    if host is not None:
        host.finish()
        result.offload_events = host.events
    result.parameters = {s: {n: t.detach().cpu().clone() for n, t in stages[s].named_parameters()} for s in hosted}
    return result


def _optimizer_sync(spec: TrainSpec, optimizer, stages: dict, device: int, replica: int) -> OptimizerSync | None:
    """Global clipping / skipping, if asked for; its process groups are made on every rank alike."""
    if spec.clip_norm is None and not spec.post_validation:
        return None
    schedule, p = spec.schedule, spec.schedule.num_devices
    groups = [dist.new_group([r * p + d for d in range(p)]) for r in range(spec.dp)]
    owners = {s: min(d for d in range(p) if s in schedule.stages_on(d)) for s in range(schedule.num_stages)}
    owned = [module for s, module in stages.items() if owners[s] == device]
    return OptimizerSync(
        optimizer,
        owned,
        spec.clip_norm,
        spec.post_validation,
        device,
        p,
        lambda d: replica * p + d,
        groups[replica],
        spec.timeout_s,
    )


def _inject_faults(spec: TrainSpec, step: int, stages: dict) -> None:
    for when, stage, kind, factor in spec.gradient_faults:
        if when != step or stage not in stages:
            continue
        grads = [p_.grad for p_ in stages[stage].parameters() if p_.grad is not None]
        if kind == "nan":
            grads[0].view(-1)[0] = float("nan")
        else:
            for grad in grads:
                grad.mul_(factor)


def _pair_groups(plan, dp: int, p: int) -> list[dict[tuple[int, int], dist.ProcessGroup]]:
    """Per replica, a process group for every ordered pair of devices that exchange messages,
    created in the same order on every rank."""
    pairs = sorted({(m.src, m.dst) for sends in plan.sends for m in sends})
    return [{(a, b): dist.new_group([replica * p + a, replica * p + b]) for a, b in pairs} for replica in range(dp)]


def _gradient_groups(schedule: Schedule, dp: int) -> dict[int, tuple[dist.ProcessGroup | None, list[int]]]:
    """Per stage, the group of every rank holding a copy of it (created in the same order on all
    ranks, as `new_group` requires; None when a stage has one copy) and those ranks."""
    p = schedule.num_devices
    groups: dict[int, tuple[dist.ProcessGroup | None, list[int]]] = {}
    for stage in range(schedule.num_stages):
        devices = [d for d in range(p) if stage in schedule.stages_on(d)]
        ranks = sorted(replica * p + d for replica in range(dp) for d in devices)
        groups[stage] = (dist.new_group(ranks) if len(ranks) > 1 else None, ranks)
    return groups


def _collective(rank: int, what: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except RuntimeError as error:
        raise RuntimeFault(f"rank {rank}: {what}: {peer_failure(error)}") from None


def _reduce_gradients(module: torch.nn.Module, group) -> None:
    if group is None:
        return
    for parameter in module.parameters():
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
    flat = torch.cat([parameter.grad.reshape(-1) for parameter in module.parameters()])
    dist.all_reduce(flat, group=group)
    offset = 0
    for parameter in module.parameters():
        size = parameter.numel()
        parameter.grad.copy_(flat[offset : offset + size].view_as(parameter))
        offset += size


def reference_training(spec: TrainSpec) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process training of the same model on the same data: (losses, parameters per stage)."""
    schedule, work = spec.schedule, spec.resolved_workload()
    stages = work.build(schedule.num_stages)
    parameters = [p for stage in stages for p in stage.parameters()]
    optimizer = torch.optim.AdamW(parameters, lr=spec.lr)
    micro = schedule.num_microbatches * spec.dp
    b = work.microbatch_size
    losses = []
    for step in range(spec.steps):
        tokens, targets = work.batch(micro * b, step)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for j in range(micro):
            x = tokens[j * b : (j + 1) * b]
            for stage in stages:
                x = stage(x)
            loss = work.loss(x, targets[j * b : (j + 1) * b])
            (loss / micro).backward()
            total += float(loss.detach()) / micro
        optimizer.step()
        losses.append(float(total))
    return losses, [{n: t.detach().clone() for n, t in stage.named_parameters()} for stage in stages]
