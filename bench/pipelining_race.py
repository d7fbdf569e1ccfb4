"""What bench/runtime_vs_torch.py and bench/real_model.py share: one rank's alternating race of
pipeloom's executor against a torch.distributed.pipelining schedule, and the simulator's
prediction of pipeloom's step from the op times it measured."""

from __future__ import annotations

import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from pipeloom import Costs, parse_op, simulate
from pipeloom.profile.profiler import ping_seconds  # noqa: F401 - the races import it from here
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.executor import DeviceExecutor
from pipeloom.runtime.host_heap import keep_freed_memory
from pipeloom.runtime.mailbox import Mailbox
from pipeloom.runtime.split_linear import WeightGradQueue, split_linears


def pipeloom_executor(schedule, rank: int, stages, boundaries, loss) -> tuple[DeviceExecutor, list]:
    """This rank's executor over its stages (split for W when its ops have W), and those modules."""
    queue = WeightGradQueue()
    own = {s: stages[s] for s in schedule.stages_on(rank)}
    if any(op.kind.value == "W" for op in schedule.devices[rank]):
        for module in own.values():
            split_linears(module, queue)
    plan = plan_messages(schedule)
    pairs = sorted({(msg.src, msg.dst) for sends in plan.sends for msg in sends})
    groups = {pair: dist.new_group(list(pair)) for pair in pairs}
    mail = Mailbox(plan, rank, boundaries, lambda d: d, groups, torch.device("cpu"), timedelta(seconds=60))
    m = schedule.num_microbatches
    executor = DeviceExecutor(schedule, rank, own, queue, mail, 1.0 / m, loss)
    return executor, list(own.values())


def torch_schedule_for(modules, stage_ids, num_stages: int, torch_class, m: int, loss):
    """torch.distributed.pipelining's schedule over this rank's stages, doing pipeloom's work: each
    micro-batch's loss divided by m before its backward, and no pass dividing every gradient after
    the last one (torch's default `scale_grads=True`, which pipeloom does not make); (schedule,
    holds first, holds last)."""

    def per_microbatch(output, target):
        return loss(output, target) / m

    stages = [pipelining.PipelineStage(modules[i], i, num_stages, torch.device("cpu")) for i in stage_ids]
    handed = stages[0] if len(stages) == 1 else stages
    schedule = torch_class(handed, m, loss_fn=per_microbatch, scale_grads=False)
    return schedule, 0 in stage_ids, num_stages - 1 in stage_ids


def torch_order(torch_schedule, name: str) -> str:
    """A multi-stage torch schedule's own order (its `pipeline_order`) as torch's compute-only CSV,
    for pipeloom to run the very same ops in the same order (`ir.torch_csv.from_torch_csv`)."""
    order = torch_schedule.pipeline_order
    return "\n".join(
        ",".join("" if action is None else str(action) for action in order[rank]) for rank in sorted(order)
    )


def race(
    executor, torch_schedule, batch, m: int, b: int, steps: int, holds_first: bool, holds_last: bool, modules=()
) -> dict:
    """Step by step, between barriers, pipeloom first on even steps and torch first on odd ones (the
    one that runs first after the gradients were dropped pays for growing the heap again): both
    step times and pipeloom's op durations by kind and stage (a fused backward counts as B, W = 0).
    Both run in this process, so both get pipeloom's steady host heap (`keep_freed_memory`)."""
    keep_freed_memory()
    ours: list[float] = []
    theirs: list[float] = []
    records = []

    def run_ours(tokens, targets) -> None:
        inputs = [(tokens[j * b : (j + 1) * b],) for j in range(m)]
        records.append(executor.run_step(inputs, [targets[j * b : (j + 1) * b] for j in range(m)]))

    def run_theirs(tokens, targets) -> None:
        if holds_first and holds_last:
            torch_schedule.step(tokens, target=targets)
        elif holds_first:
            torch_schedule.step(tokens)
        elif holds_last:
            torch_schedule.step(target=targets)
        else:
            torch_schedule.step()

    for step in range(steps):
        tokens, targets = batch(m * b, step)
        turns = [(run_ours, ours), (run_theirs, theirs)]
        for run, times in turns if step % 2 == 0 else turns[::-1]:
            for module in modules:
                module.zero_grad(set_to_none=True)
            dist.barrier()
            began = time.perf_counter()
            run(tokens, targets)
            dist.barrier()
            times.append(time.perf_counter() - began)
    durations: dict[str, list[float]] = {}
    for record in records[1:]:
        for text, start, end in record.ops:
            op = parse_op(text)
            kind = "B" if op.kind.value == "BW" else op.kind.value
            durations.setdefault(f"{kind}{op.stage}", []).append(end - start)
    return {"ours": ours, "theirs": theirs, "durations": durations}


def summarise(results: list[dict], schedule) -> dict:
    """Median steps of rank 0 (first step left out), the median of their step-by-step ratios (each
    step's two runs are neighbours in time, so the ratio of a pair leaves out the machine's drift
    across the run), and the simulated step from every rank's op times."""
    durations: dict[str, list[float]] = {}
    for result in results:
        for key, values in result["durations"].items():
            durations.setdefault(key, []).extend(values)
    stages = range(schedule.num_stages)
    measured = Costs(
        F=[statistics.median(durations[f"F{s}"]) for s in stages],
        B=[statistics.median(durations[f"B{s}"]) for s in stages],
        W=[statistics.median(durations.get(f"W{s}", [0.0])) for s in stages],
        comm=results[0]["ping"],
    )
    return {
        "ours": statistics.median(results[0]["ours"][1:]),
        "theirs": statistics.median(results[0]["theirs"][1:]),
        "ratio": statistics.median(a / b for a, b in zip(results[0]["ours"][1:], results[0]["theirs"][1:])),
        "predicted": simulate(schedule, measured).makespan,
    }
