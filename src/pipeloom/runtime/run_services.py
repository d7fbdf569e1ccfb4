"""What a rank runs besides its training steps, each built at set-up from the spec: the
learning-rate schedule over its optimizers, the held-out evaluation (a forward-only executor with
its own mailbox) and, on one rank, the metrics log. Every rank builds them in the same order,
since an evaluation mailbox over torch.distributed makes process groups."""

from __future__ import annotations

import resource
import sys

import torch

from pipeloom.models.context_parallel import ContextShard
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.evaluation import Evaluation
from pipeloom.runtime.executor import DeviceExecutor
from pipeloom.runtime.lr_schedule import LearningRate
from pipeloom.runtime.metrics import throughput
from pipeloom.runtime.offload import HostOffload
from pipeloom.runtime.rank_setup import Transport, leaves_of, mailbox_of
from pipeloom.runtime.run_log import RunLog
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.runtime.step_state import StepRecord
from pipeloom.schedules.forward_only import forward_only_of

__all__ = ["learning_rate_of", "evaluation_of", "run_log_of", "step_facts"]


def learning_rate_of(spec: TrainSpec, stepper, host: HostOffload | None) -> LearningRate:
    """One scheduler per optimizer this rank steps; the host's steps in the host's worker."""
    learning = LearningRate(spec.optimizer.curve(spec.steps))
    for part in leaves_of(stepper):
        if part.optimizer is not None:
            learning.add(part.optimizer)
    if host is not None:
        learning.add(host.optimizer, host.after_pending)
    return learning


def evaluation_of(
    spec: TrainSpec,
    transport: Transport,
    training: DeviceExecutor,
    probe,
    coords: tuple[int, int, int],
    where: torch.device,
    microbatch_size: int,
    context: ContextShard | None = None,
) -> Evaluation | None:
    """The forward-only twin of the training schedule on this rank's stages, or None."""
    if not spec.eval_every or spec.eval_data is None:
        return None
    replica, device, tp_index = coords
    parallel = spec.parallelism
    schedule = forward_only_of(parallel.schedule)
    mail = mailbox_of(parallel, transport, plan_messages(schedule), device, replica, tp_index, probe, where)
    executor = DeviceExecutor(
        schedule,
        device,
        training.stages,
        training.queue,
        mail,
        loss=training.loss_fn,
        loss_context=training.loss_context,
        loss_scale=training.loss_scale,
        device_type=where,
        before_forward=training.before_forward,
        precision=training.precision,
    )
    return Evaluation(
        executor,
        spec.eval_data,
        spec.eval_every,
        spec.eval_batches,
        microbatch_size,
        schedule.num_microbatches,
        parallel.dp,
        parallel.layout.samples_of(replica)[0],
        where,
        context,
    )


def run_log_of(spec: TrainSpec, rank: int) -> RunLog | None:
    """The metrics log, on the rank holding the last stage of the first replica (tp index 0)."""
    if spec.log_dir is None:
        return None
    parallel = spec.parallelism
    schedule = parallel.schedule
    last = next(d for d in range(schedule.num_devices) if schedule.num_stages - 1 in schedule.stages_on(d))
    if rank != parallel.layout.rank(0, last, 0):
        return None
    return RunLog(spec.log_dir, spec.run_config, spec.wandb)


def step_facts(result: RankResult, record: StepRecord, lr: float | None, peak_tflops: float | None) -> dict:
    """A step's line of the metrics log, from this rank's result (units in the names)."""
    seconds = result.step_seconds[-1]
    speed = throughput(result, seconds, peak_tflops)
    gpu = torch.cuda.is_available() and torch.cuda.is_initialized()
    scale = 1024 if sys.platform != "darwin" else 1  # ru_maxrss: KiB on Linux, bytes on macOS
    return {
        "loss": result.losses[-1],
        "lr": lr,
        "step_ms": seconds * 1e3,
        "tokens_per_second": speed["tokens_per_second"],
        "tflops": speed["tflops"],
        "mfu": speed["mfu"],
        "peak_stash_bytes": record.peak_stash_bytes,
        "gpu_peak_bytes": int(torch.cuda.max_memory_allocated()) if gpu else None,
        "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        "loss_scale": result.loss_scales[-1] if result.loss_scales else None,
    }
