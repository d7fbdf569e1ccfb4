"""Training with a pipeline schedule on a pp × dp grid of processes, and its single-process reference.

`train_rank` is one rank over torch.distributed: it joins the process group and drives
`rank.RankRun` (set-up, then per step the device's op list, the sum of each stage's gradients
over every copy of it — data-parallel replicas, Chimera's second pipeline, tied weights — the
optimizer step and the loss all-reduce, then teardown), turning a peer's failure into one line.
`reference_training` runs the same model on the same data in one process — what every schedule
must reproduce.
"""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.errors import RuntimeFault
from pipeloom.models.workload import rows_of
from pipeloom.runtime.boundary import StageProbe
from pipeloom.runtime.gradients import unique_parameters
from pipeloom.runtime.host_heap import keep_freed_memory
from pipeloom.runtime.lr_schedule import build_scheduler
from pipeloom.runtime.mailbox import peer_failure
from pipeloom.runtime.optimizer_sync import decide, step_under
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.rank import RankRun, Transport
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.runtime.spec_checks import check_device, check_spec
from pipeloom.runtime.stage_call import run_stage
from pipeloom.runtime.zero import adamw, squares_and_bad

__all__ = ["TrainSpec", "check_spec", "check_device", "train_rank", "reference_training", "RankResult"]


def train_rank(
    spec: TrainSpec,
    rank: int,
    world_size: int,
    rendezvous: str | dist.Store,
    gather: bool = False,
    probe: StageProbe | None = None,
    tear_down: bool = True,
) -> RankResult:
    """Run `spec` as one rank of the process group, met at `rendezvous` (an init method such as
    "env://", or a store); ranks return their own results, and with `gather` rank 0's result
    also carries every rank's (`all_results`). `probe`: the stage boundaries, when the launcher
    probed them once for all ranks.

    `tear_down=False` leaves the process group up, for a process that ends right after (the
    launcher's gloo ranks): gloo's event loop sees a shutdown only at its next 10 ms poll, and a
    run's dozen groups each wait for theirs — a third of a small run's time — while the exit
    closes the same connections at once."""
    check_spec(spec, world_size)
    torch.set_num_threads(spec.threads)
    if spec.torch_device_type == "cpu":
        keep_freed_memory()  # steps re-use their host memory instead of faulting it in anew
    if spec.torch_device_type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % max(1, torch.cuda.device_count()))))
    meet = {"store": rendezvous} if isinstance(rendezvous, dist.Store) else {"init_method": rendezvous}
    dist.init_process_group(
        spec.resolved_backend,
        **meet,
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=spec.timeout_s),
    )
    try:
        result = _train(spec, rank, probe)
        if gather:  # the figures only: weights and gradients stay where they are
            collected = [None] * world_size if rank == 0 else None
            dist.gather_object(replace(result, parameters={}, gradients={}), collected, dst=0)
            result.all_results = collected
        return result
    except RuntimeError as error:  # a peer died or stalled: one clear line on every rank
        raise RuntimeFault(f"rank {rank}: {peer_failure(error)}") from None
    finally:
        if tear_down:
            dist.destroy_process_group()


def _train(spec: TrainSpec, rank: int, probe: StageProbe | None) -> RankResult:
    """Set-up, the step loop, teardown: one rank, its peers in other processes."""
    run = RankRun.set_up(spec, rank, Transport(dist.get_world_size()), probe=probe)
    world = list(range(dist.get_world_size()))
    for step in range(run.first_step, spec.steps):
        inputs, targets = run.begin_step(step)
        record = run.executor.run_step(inputs, targets)
        run.pipeline_done()
        _collective(
            rank, f"the all-reduce of gradients with ranks {run.groups.buckets.describe()}", run.groups.buckets.reduce
        )
        run.step_optimizer(step, lambda what, call: _collective(rank, what, call))
        shares = run.loss_shares(record)
        _collective(rank, f"the all-reduce of the loss with ranks {world}", dist.all_reduce, shares[:1])
        run.end_step(step, record, run.settle_step(record, shares))
        if run.services.evaluation is not None and run.services.evaluation.due(step):
            began = time.perf_counter()
            held_out = _evaluate(run, rank, world)
            run.end_evaluation(step, held_out, time.perf_counter() - began)
    return run.tear_down()


def _evaluate(run: RankRun, rank: int, world: list[int]) -> float:
    """The held-out loss: each batch's forward-only step, summed over the ranks; their mean."""
    evaluation = run.services.evaluation
    assert evaluation is not None
    total = torch.zeros((), dtype=torch.float64, device=run.model.where)
    for index in range(evaluation.batches):
        record = evaluation.executor.run_step(*evaluation.data(index))
        total += run.loss_shares(record)[0]
    _collective(rank, f"the all-reduce of the evaluation loss with ranks {world}", dist.all_reduce, total)
    return float(total) / evaluation.batches


def _collective(rank: int, what: str, call, *args, **kwargs) -> None:
    try:
        call(*args, **kwargs)
    except RuntimeError as error:
        raise RuntimeFault(f"rank {rank}: {what}: {peer_failure(error)}") from None


def reference_training(
    spec: TrainSpec, gradients: list | None = None, norms: list | None = None
) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Single-process training of the same model on the same data, in the same precision (stage
    outputs cast to the compute type as the pipeline sends them), clipped to the spec's global
    norm by the runtime's own rule (`optimizer_sync.decide`): (losses, parameters per stage).
    A `gradients` list receives the last step's gradients per stage; a `norms` list each step's
    global gradient norm before clipping, where the spec clips."""
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)  # the ranks' kernels, blocked and summed as they are
    try:
        return _reference(spec, gradients, norms)
    finally:
        torch.set_num_threads(threads)


def _reference(spec: TrainSpec, gradients: list | None, norms: list | None):
    schedule, work = spec.schedule, spec.resolved_workload()
    precision, cpu = Precision(spec.dtype), torch.device("cpu")
    stages = work.build(schedule.num_stages)
    parameters = unique_parameters(stages)
    optimizer = adamw(parameters, spec.lr)  # the ranks' own AdamW (fused)
    scheduler = build_scheduler(optimizer, spec.optimizer.schedule, spec.steps)
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
        if spec.clip_norm is not None:
            state = squares_and_bad([t.grad for t in parameters if t.grad is not None], cpu)
            decision = decide(state, spec.clip_norm)
            if norms is not None:
                norms.append(float(state[0].sqrt()) if state[1] == 0 else math.nan)
            torch._foreach_mul_([t.grad for t in parameters if t.grad is not None], decision[1])
            step_under(optimizer, decision)
        else:
            optimizer.step()
        scheduler.step()
        losses.append(float(total))
    return losses, [{n: t.detach().clone() for n, t in stage.named_parameters()} for stage in stages]
