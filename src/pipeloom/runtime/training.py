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
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.errors import RuntimeFault
from pipeloom.ir.ops import OpKind
from pipeloom.runtime.boundary import StageProbe, probe_stages
from pipeloom.runtime.checkpoint import find_checkpoint, load_checkpoint, save_checkpoint
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.executor import DeviceExecutor, peer_failure
from pipeloom.runtime.gradients import GradientBuckets, grad_of, unique_parameters
from pipeloom.runtime.offload import HostOffload
from pipeloom.runtime.optimizer_sync import OptimizerSync
from pipeloom.runtime.precision import LossScaler, Precision
from pipeloom.runtime.spec import RankResult, TrainSpec, check_device, check_spec
from pipeloom.runtime.split_linear import WeightGradQueue, split_linears
from pipeloom.runtime.stage_call import run_stage
from pipeloom.runtime.workload import Workload, rows_of
from pipeloom.runtime.zero import JointSteppers, ReplicatedAdamW, ShardedAdamW
from pipeloom.tune.static_memory import compute_bytes, static_bytes

__all__ = ["TrainSpec", "check_spec", "check_device", "train_rank", "reference_training", "RankResult"]


def train_rank(spec: TrainSpec, rank: int, world_size: int, init_method: str, gather: bool = False) -> RankResult:
    """Run `spec` as one rank of the process group; ranks return their own results, and with
    `gather` rank 0's result also carries every rank's (`all_results`)."""
    check_spec(spec, world_size)
    torch.set_num_threads(spec.threads)
    if spec.torch_device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    dist.init_process_group(
        spec.resolved_backend,
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
    where = (
        torch.device("cuda", torch.cuda.current_device()) if spec.torch_device_type == "cuda" else torch.device("cpu")
    )
    precision = Precision(spec.dtype)
    all_stages = work.build(schedule.num_stages)
    probe = _probe(spec, work, all_stages, precision)
    hosted = schedule.stages_on(device)
    buckets = GradientBuckets(schedule, spec.dp, all_stages, rank, across_replicas=spec.zero == 0)
    dp_groups = [dist.new_group([r * p + d for r in range(spec.dp)]) for d in range(p)] if spec.zero else None
    queue = WeightGradQueue()
    stages = {s: all_stages[s].to(where) for s in hosted}
    if any(op.kind is OpKind.W for op in schedule.devices[device]):  # fused backwards keep plain linears
        for module in stages.values():
            split_linears(module, queue)
    offloaded = [s for s in hosted if s in spec.offload_stages]
    owned = _owned(schedule, all_stages, device)
    host = None
    if offloaded:
        dp_group = dp_groups[device] if spec.zero else None  # else the buckets sum over the replicas
        host = HostOffload(stages, offloaded, spec.lr, spec.reload_bits, precision.dtype, owned, dp_group)
    on_host = {id(p_) for s in offloaded for p_ in stages[s].parameters()}
    parameters = [p_ for p_ in unique_parameters([stages[s] for s in hosted]) if id(p_) not in on_host]
    if spec.zero:
        stepper = ShardedAdamW(
            parameters, owned, spec.lr, spec.zero, dp_groups[device], precision.dtype, label=f"device{device}"
        )
    else:
        stepper = ReplicatedAdamW(parameters, owned, spec.lr)
    plan = plan_messages(schedule)
    pair_groups = _pair_groups(plan, spec.dp, p)[replica]
    executor = DeviceExecutor(
        schedule,
        plan,
        device,
        stages,
        queue,
        rank_of=lambda d: replica * p + d,
        boundaries=probe.boundaries,
        loss=work.loss,
        loss_scale=1.0 / (schedule.num_microbatches * spec.dp * schedule.num_slices),
        concat_w=spec.concat_w,
        pair_groups=pair_groups,
        device_type=where,
        timeout_s=spec.timeout_s,
        before_forward=host.reload if host else None,
        precision=precision,
        recompute_layers=spec.recompute_layers,
    )
    scaler = LossScaler(spec.initial_loss_scale, spec.loss_scale_growth_interval) if spec.dtype == "fp16" else None
    holders = [stepper] + ([host] if host is not None else [])  # what a checkpoint saves besides weights
    optimizers = JointSteppers(host, stepper) if host is not None else stepper  # the host's starts first
    sync = _optimizer_sync(spec, optimizers, device, replica, scaler)
    m, b = schedule.num_microbatches, work.microbatch_size
    result = RankResult(rank, sample_tokens=work.sample_tokens, samples_per_step=spec.dp * m * b)
    result.forward_flops = m * sum(probe.forward_flops[s] for s in hosted)
    progress = _progress(spec, rank, result)
    first = 0
    if spec.resume_dir is not None:
        path, _ = find_checkpoint(spec.resume_dir, dist.get_world_size(), schedule.name, spec.zero, spec.offload_stages)
        first = load_checkpoint(path, stages, holders)
    if where.type == "cuda":
        torch.cuda.reset_peak_memory_stats(where)
    for step in range(first, spec.steps):
        began = time.perf_counter()
        inputs, targets = work.batch(spec.dp * m * b, step)
        rows = [slice((replica * m + j) * b, (replica * m + j + 1) * b) for j in range(m)]
        micro_inputs = [tuple(t.to(where) for t in rows_of(inputs, r)) for r in rows]
        micro_targets = [targets[r].to(where) for r in rows]
        if sync is not None:
            sync.validate()  # the previous step, against the full state the last device sent back
        optimizers.zero_grad()
        if scaler is not None:
            executor.grad_scale = scaler.scale
            result.loss_scales.append(scaler.scale)
        piped = time.perf_counter()
        record = executor.run_step(micro_inputs, micro_targets)
        reducing = time.perf_counter()
        _collective(rank, f"the all-reduce of gradients with ranks {buckets.describe()}", buckets.reduce)
        _inject_faults(spec, step, stages)
        _collective(rank, "the data-parallel reduction of the sharded gradients", optimizers.reduce)
        stepping = time.perf_counter()
        if scaler is not None:
            optimizers.scale(1.0 / scaler.scale)
        if spec.record_gradients:
            result.gradients = {
                s: {
                    n: grad_of(t).detach().float().cpu().clone()
                    for n, t in stages[s].named_parameters()
                    if grad_of(t) is not None
                }
                for s in hosted
            }
        if sync is not None:  # the host steps offloaded stages while this rank goes on
            sync.step(step)
        else:
            optimizers.step()
        stepped = time.perf_counter()
        loss = torch.tensor([record.loss], dtype=torch.float64, device=where)
        _collective(
            rank, f"the all-reduce of the loss with ranks {list(range(dist.get_world_size()))}", dist.all_reduce, loss
        )
        result.losses.append(float(loss))
        result.step_seconds.append(time.perf_counter() - began)
        result.phase_seconds.append(
            {
                "pipeline": reducing - piped,
                "allreduce": stepping - reducing,
                "optimizer": stepped - stepping,
                "overhead": result.step_seconds[-1] - (stepped - piped),
            }
        )
        result.records.append(record)
        if progress is not None:
            progress(step)
        if spec.save_every and (step + 1) % spec.save_every == 0:
            if sync is not None:
                sync.validate()
            save_checkpoint(spec.save_dir, step + 1, stages, holders, schedule.name, spec.zero, spec.offload_stages)
    if sync is not None:
        sync.validate()
        result.rollbacks, result.skipped_steps = sync.rollbacks, sync.skipped
    if progress is not None:
        progress(None)
    if host is not None:
        host.finish()
        result.offload_events = host.events
    if where.type == "cuda":
        result.peak_memory_bytes = int(torch.cuda.max_memory_allocated(where))
    result.static_bytes, result.planned_static_bytes = _static_bytes(spec, stepper, host, parameters, precision)
    result.parameters = {s: {n: t.detach().cpu().clone() for n, t in stages[s].named_parameters()} for s in hosted}
    return result


def _probe(spec: TrainSpec, work: Workload, all_stages, precision: Precision) -> StageProbe:
    """Boundary shapes and forward FLOPs from one micro-batch of step 0 (a slice, with slices)."""
    inputs, _ = work.batch(work.microbatch_size, 0)
    example = rows_of(inputs, slice(0, work.microbatch_size))
    slices = spec.schedule.num_slices
    if slices > 1:
        example = tuple(t[:, : t.shape[1] // slices] for t in example)
    past = [] if slices > 1 else None
    cpu = torch.device("cpu")
    return probe_stages(all_stages, example, lambda module, x: run_stage(module, x, past, precision, cpu, True)[0])


def _progress(spec: TrainSpec, rank: int, result: RankResult):
    if not spec.report or rank != 0:
        return None
    from pipeloom.runtime.metrics import StepReporter

    return StepReporter(result, spec.steps, spec.peak_tflops)


def _optimizer_sync(spec: TrainSpec, stepper, device: int, replica: int, scaler: LossScaler | None):
    """Global clipping / skipping (also fp16's overflow skip), if asked for; its process groups
    are made on every rank alike."""
    if spec.clip_norm is None and not spec.post_validation and scaler is None:
        return None
    p = spec.schedule.num_devices
    groups = [dist.new_group([r * p + d for d in range(p)]) for r in range(spec.dp)]
    return OptimizerSync(
        stepper,
        spec.clip_norm,
        spec.post_validation,
        device,
        p,
        lambda d: replica * p + d,
        groups[replica],
        spec.timeout_s,
        on_decision=scaler.update if scaler is not None else None,
    )


def _owned(schedule, all_stages, device: int):
    """Whether this device counts a parameter in the global gradient norm: each counts once, on
    the lowest device hosting its first stage."""
    owners = {
        s: min(d for d in range(schedule.num_devices) if s in schedule.stages_on(d)) for s in range(schedule.num_stages)
    }
    first_stage: dict[int, int] = {}
    for s, module in enumerate(all_stages):
        for parameter in module.parameters():
            first_stage.setdefault(id(parameter), s)
    return lambda parameter: owners[first_stage[id(parameter)]] == device


def _static_bytes(spec: TrainSpec, stepper, host, parameters, precision: Precision) -> tuple[dict, dict]:
    """(measured, planned) weight, gradient, optimizer and host bytes of this rank: the tensors it
    holds, beside `pipeloom.tune.static_memory`'s figures for as many weights."""
    compute = compute_bytes(precision.name)
    measured = {
        "weights": stepper.weight_bytes,
        "gradients": stepper.gradient_bytes,
        "optimizer": stepper.optimizer_bytes,
        "host": 0,
    }
    planned = static_bytes(
        sum(t.numel() for t in parameters), spec.dp, spec.zero, compute=compute, padded=True
    ).to_dict()
    planned.pop("device")
    if host is not None:
        on_host = [t for params in host.device_params.values() for t in params]
        offloaded = static_bytes(sum(t.numel() for t in on_host), offloaded=True, compute=compute)
        measured["weights"] += sum(t.numel() * t.element_size() for t in on_host)
        measured["gradients"] += host.store.bytes
        measured["host"] = host.host_bytes
        planned["weights"] += offloaded.weights
        planned["gradients"] += offloaded.gradients
        planned["host"] = offloaded.host
    return measured, planned


def _inject_faults(spec: TrainSpec, step: int, stages: dict) -> None:
    for when, stage, kind, factor in spec.gradient_faults:
        if when != step or stage not in stages:
            continue
        grads = [grad_of(p_) for p_ in stages[stage].parameters() if grad_of(p_) is not None]
        if kind == "nan":
            grads[0].view(-1)[0] = float("nan")
        elif kind == "inf":
            grads[0].view(-1)[0] = float("inf")
        else:
            for grad in grads:
                grad.mul_(factor)


def _pair_groups(plan, dp: int, p: int) -> list[dict[tuple[int, int], dist.ProcessGroup]]:
    """Per replica, a process group for every ordered pair of devices that exchange messages,
    created in the same order on every rank."""
    pairs = sorted({(m.src, m.dst) for sends in plan.sends for m in sends})
    return [{(a, b): dist.new_group([replica * p + a, replica * p + b]) for a, b in pairs} for replica in range(dp)]


def _collective(rank: int, what: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except RuntimeError as error:
        raise RuntimeFault(f"rank {rank}: {what}: {peer_failure(error)}") from None


def reference_training(
    spec: TrainSpec, gradients: list | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process training of the same model on the same data, in the same precision (stage
    outputs cast to the compute type as the pipeline sends them): (losses, parameters per stage).
    A `gradients` list receives the last step's gradients per stage."""
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)  # the ranks' kernels, blocked and summed as they are
    try:
        return _reference(spec, gradients)
    finally:
        torch.set_num_threads(threads)


def _reference(spec: TrainSpec, gradients: list | None):
    schedule, work = spec.schedule, spec.resolved_workload()
    precision, cpu = Precision(spec.dtype), torch.device("cpu")
    stages = work.build(schedule.num_stages)
    optimizer = torch.optim.AdamW(unique_parameters(stages), lr=spec.lr)
    micro = schedule.num_microbatches * spec.dp
    b = work.microbatch_size
    losses = []
    for step in range(spec.steps):
        inputs, targets = work.batch(micro * b, step)
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), dtype=torch.float64)
        for j in range(micro):
            x = rows_of(inputs, slice(j * b, (j + 1) * b))
            for index, stage in enumerate(stages):
                x, _ = run_stage(stage, x, None, precision, cpu, hand_on=index < len(stages) - 1)
            loss = work.loss(x[0] if len(x) == 1 else x, targets[j * b : (j + 1) * b]).float()
            (loss / micro).backward()
            total += float(loss.detach()) / micro
        if gradients is not None:
            gradients[:] = [
                {n: t.grad.detach().clone() for n, t in stage.named_parameters() if t.grad is not None}
                for stage in stages
            ]
        optimizer.step()
        losses.append(float(total))
    return losses, [{n: t.detach().clone() for n, t in stage.named_parameters()} for stage in stages]
