"""Every device of a schedule in this one process: the runtime without processes or a backend.

The correctness of a schedule — the same gradients as one process — does not depend on the
transport, so checking it need not fork ranks, rendezvous and build process groups (most of a
small run's time). `run_in_process` sets every rank up with the code the ranks run
(`rank.RankRun`), hands each executor a mailbox in memory, and runs their ops one unit at a time:
a device runs its next op as soon as the messages it needs are there, each device in its own
order. Any order that respects the dependencies gives the same numbers, since each device's
arithmetic follows its own op list, and the buckets are summed in rank order as gloo's two-rank
all-reduce would. A step in which no device can go on is a deadlock, named by the ops waiting.

On a GPU every device of the schedule is the one GPU (`torch_device_of`): p stages and their
replicas in one process on one device, messages handed over without a copy — so a machine with
one GPU runs the executor with many stages, recompute, W parts and overlapped pairs (each rank's
`peak_memory_bytes` is then the GPU's, every stage's). It covers the pipeline, its data-parallel
replicas and the gradient sums between copies of a stage (Chimera, tied embeddings), in every
precision; clipping, post-validation, fp16 loss
scaling, ZeRO, host offload, checkpoints and timeouts talk to other ranks through
torch.distributed and are run by `local.run_local`.
"""

from __future__ import annotations

import time
from typing import cast

import torch

from pipeloom.errors import ConfigError, ScheduleError
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.executor import DeviceExecutor
from pipeloom.runtime.gradients import reduce_in_process
from pipeloom.runtime.memory_mailbox import MemoryMailbox, Postbox
from pipeloom.runtime.probe import check_probe_fits, probe_spec
from pipeloom.runtime.rank import RankRun, Transport
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.runtime.spec_checks import check_spec

__all__ = ["run_in_process"]


def run_in_process(spec: TrainSpec) -> list[RankResult]:
    """Train `spec` with all p × dp ranks in this process; their results by rank, as `run_local`'s."""
    world_size = spec.parallelism.layout.world_size
    check_spec(spec, world_size)
    _check_in_process(spec)
    threads = torch.get_num_threads()
    torch.set_num_threads(spec.threads)  # each rank's kernels, blocked and summed as a rank's are
    try:
        return _train_all(spec, world_size)
    finally:
        torch.set_num_threads(threads)


def _train_all(spec: TrainSpec, world_size: int) -> list[RankResult]:
    layout = spec.parallelism.layout
    plan = plan_messages(spec.schedule)
    postboxes: list[Postbox] = [{} for _ in range(spec.dp)]
    probe = probe_spec(spec)
    check_probe_fits(spec, probe)
    runs = [
        RankRun.set_up(spec, rank, Transport(world_size, postboxes[layout.coords(rank)[0]]), plan, probe)
        for rank in range(world_size)
    ]
    for step in range(spec.steps):
        data = [run.begin_step(step) for run in runs]
        for replica in range(spec.dp):
            ranks = [layout.rank(replica, d) for d in range(spec.schedule.num_devices)]
            _drive([runs[r].executor for r in ranks], [data[r] for r in ranks])
        records = [run.executor.finish() for run in runs]
        for run in runs:
            run.pipeline_done()
        reduce_in_process([run.groups.buckets for run in runs])
        for run in runs:
            run.step_optimizer(step, lambda _, call: call())
        shares = [run.loss_shares(record) for run, record in zip(runs, records)]
        total = _sum_losses(shares)
        for share in shares:
            share[0] = total
        for run, record, share in zip(runs, records, shares):
            run.end_step(step, record, run.settle_step(record, share))
        if runs[0].services.evaluation is not None and runs[0].services.evaluation.due(step):
            began = time.perf_counter()
            held_out = _evaluate(runs, spec)
            for run in runs:
                run.end_evaluation(step, held_out, time.perf_counter() - began)
    return [run.tear_down() for run in runs]


def _evaluate(runs: list[RankRun], spec: TrainSpec) -> float:
    """The held-out loss, every rank's forward-only executor driven as a training step's are."""
    evaluations = [run.services.evaluation for run in runs]
    total = 0.0
    for index in range(spec.eval_batches):
        data = [evaluation.data(index) for evaluation in evaluations if evaluation is not None]
        executors = [evaluation.executor for evaluation in evaluations if evaluation is not None]
        layout = spec.parallelism.layout
        for replica in range(spec.dp):
            ranks = [layout.rank(replica, d) for d in range(spec.schedule.num_devices)]
            _drive([executors[r] for r in ranks], [data[r] for r in ranks])
        total += float(_sum_losses([run.loss_shares(executor.finish()) for run, executor in zip(runs, executors)]))
    return total / spec.eval_batches


def _drive(executors: list[DeviceExecutor], data: list[tuple[list, list]]) -> None:
    """Run the devices' op lists to their ends, each op once the messages it needs are in."""
    for executor, (inputs, targets) in zip(executors, data):
        executor.begin(inputs, targets)
    mailboxes = [cast(MemoryMailbox, executor.mail) for executor in executors]
    while True:
        progressed, waiting = False, []
        for executor, mail in zip(executors, mailboxes):
            while not executor.done and all(mail.has(key) for key in executor.needs()):
                executor.advance()
                progressed = True
            if not executor.done:
                waiting.append(f"device {executor.device} at {executor.next_op.text}")
        if not waiting:
            return
        if not progressed:
            raise ScheduleError(f"deadlock: every device waits for a message ({', '.join(waiting)})")


def _sum_losses(shares: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss as the ranks' float64 all-reduce gives it: every rank's share, summed."""
    total = torch.zeros((), dtype=torch.float64, device=shares[0].device)
    for share in shares:
        total += share[0]
    return total


def _check_in_process(spec: TrainSpec) -> None:
    needs_ranks = {
        "ZeRO": spec.zero != 0,
        "host offload": bool(spec.offload_stages),
        "clipping": spec.clip_norm is not None,
        "post-validation": spec.post_validation,
        "fp16 loss scaling": spec.dtype == "fp16",
        "checkpoints": spec.save_every > 0 or spec.resume_dir is not None,
        "tensor parallelism (DTensor collectives over a process group)": spec.tp > 1,
        "context parallelism (its keys and values gathered over a process group)": spec.cp > 1,
    }
    named = [what for what, used in needs_ranks.items() if used]
    if named:
        raise ConfigError(f"run_in_process: {', '.join(named)} need one process per rank; use run_local")
