"""pipeloom's runtime against torch.distributed.pipelining, same model, same micro-batches.

2 and 4 ranks (gloo, one thread each), schedules 1F1B, interleaved (2 chunks) and ZB-V, model
hidden 512 so that compute dominates the messages. Each step runs once with pipeloom's executor
and once with torch's matching schedule class, alternately in one job, between barriers; the
script prints both median step times (first step left out), their ratio (goal ≤ 1.0), and the
step time the simulator predicts from the F and B times and the p2p time measured in this run.
Usage: python bench/runtime_vs_torch.py [--steps 4] [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import pipelining

from pipeloom import Costs, build_schedule, parse_op, simulate
from pipeloom.models.llama import LlamaConfig
from pipeloom.runtime.comm import plan_messages
from pipeloom.runtime.boundary import TensorSpec
from pipeloom.runtime.executor import DeviceExecutor
from pipeloom.runtime.split_linear import WeightGradQueue, split_linears
from pipeloom.runtime.workload import llama_workload

CONFIG = LlamaConfig(vocab=512, hidden=512, layers=8, heads=8, ffn=1024, seq_len=64, microbatch_size=2)
CASES = {  # name -> (pipeloom generator, kwargs, torch schedule class, stages of rank d)
    "1f1b": ("1f1b", {}, pipelining.Schedule1F1B, lambda d, p: [d]),
    "interleaved": ("interleaved", {"num_chunks": 2}, pipelining.ScheduleInterleaved1F1B, lambda d, p: [d, d + p]),
    "zb-v": ("zb-v", {}, pipelining.ScheduleZBVZeroBubble, lambda d, p: [d, 2 * p - 1 - d]),
}


def _rank(rank: int, world: int, directory: str, case: str, steps: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=world)
    name, kwargs, torch_class, stages_of = CASES[case]
    p, m = world, 2 * world
    costs_hint = Costs(F=1, B=1, W=1)
    schedule = build_schedule(name, p, m, **({"costs": costs_hint} if name == "zb-v" else kwargs))
    work = llama_workload(CONFIG, seed=0)
    b = CONFIG.microbatch_size

    # pipeloom
    stages = work.build(schedule.num_stages)
    queue = WeightGradQueue()
    own = {s: stages[s] for s in schedule.stages_on(rank)}
    if any(op.kind.value == "W" for op in schedule.devices[rank]):
        for module in own.values():
            split_linears(module, queue)
    plan = plan_messages(schedule)
    pairs = sorted({(msg.src, msg.dst) for sends in plan.sends for msg in sends})
    groups = {pair: dist.new_group(list(pair)) for pair in pairs}
    activation_shape = (b, CONFIG.seq_len, CONFIG.hidden)
    boundaries = [(TensorSpec(activation_shape, torch.float32),)] * schedule.num_stages
    executor = DeviceExecutor(
        schedule, plan, rank, own, queue, lambda d: d, boundaries, 1.0 / m, work.loss, pair_groups=groups
    )

    # torch.distributed.pipelining
    torch_modules = work.build(schedule.num_stages)
    torch_stages = [
        pipelining.PipelineStage(torch_modules[i], i, schedule.num_stages, torch.device("cpu"))
        for i in stages_of(rank, p)
    ]
    torch_schedule = (
        torch_class(torch_stages[0], m, loss_fn=work.loss)
        if len(torch_stages) == 1
        else torch_class(torch_stages, m, loss_fn=work.loss)
    )
    holds_first = 0 in stages_of(rank, p)
    holds_last = schedule.num_stages - 1 in stages_of(rank, p)

    # p2p time of one activation, for the simulator
    probe = torch.randn(activation_shape)
    pings = []
    for _ in range(5):
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(probe, 1)
            dist.recv(probe, 1)
        elif rank == 1:
            dist.recv(probe, 0)
            dist.send(probe, 0)
        pings.append((time.perf_counter() - began) / 2)

    ours, theirs, records = [], [], []
    for step in range(steps):
        tokens, targets = work.batch(m * b, step)
        dist.barrier()
        began = time.perf_counter()
        record = executor.run_step(
            [(tokens[j * b : (j + 1) * b],) for j in range(m)], [targets[j * b : (j + 1) * b] for j in range(m)]
        )
        dist.barrier()
        ours.append(time.perf_counter() - began)
        records.append(record)
        dist.barrier()
        began = time.perf_counter()
        if holds_first and holds_last:
            torch_schedule.step(tokens, target=targets)
        elif holds_first:
            torch_schedule.step(tokens)
        elif holds_last:
            torch_schedule.step(target=targets)
        else:
            torch_schedule.step()
        dist.barrier()
        theirs.append(time.perf_counter() - began)
    durations: dict[str, list[float]] = {}
    for record in records[1:]:
        for text, start, end in record.ops:
            op = parse_op(text)
            kind = "B" if op.kind.value == "BW" else op.kind.value  # a fused backward is B with W = 0
            durations.setdefault(f"{kind}{op.stage}", []).append(end - start)
    Path(directory, f"rank{rank}.json").write_text(
        json.dumps({"ours": ours, "theirs": theirs, "durations": durations, "ping": statistics.median(pings)})
    )
    dist.destroy_process_group()


def run_case(case: str, world: int, steps: int) -> dict:
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as directory:
        processes = [context.Process(target=_rank, args=(r, world, directory, case, steps)) for r in range(world)]
        for process in processes:
            process.start()
        for process in processes:
            process.join()
        if any(process.exitcode for process in processes):
            raise SystemExit(f"{case} with {world} ranks failed")
        results = [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(world)]
    ours = statistics.median(results[0]["ours"][1:])
    theirs = statistics.median(results[0]["theirs"][1:])
    durations: dict[str, list[float]] = {}
    for result in results:
        for key, values in result["durations"].items():
            durations.setdefault(key, []).extend(values)
    name, kwargs, _, _ = CASES[case]
    schedule = build_schedule(name, world, 2 * world, **({"costs": Costs(F=1, B=1, W=1)} if name == "zb-v" else kwargs))
    stages = range(schedule.num_stages)
    measured = Costs(
        F=[statistics.median(durations[f"F{s}"]) for s in stages],
        B=[statistics.median(durations[f"B{s}"]) for s in stages],
        W=[statistics.median(durations.get(f"W{s}", [0.0])) for s in stages],
        comm=results[0]["ping"],
    )
    predicted = simulate(schedule, measured).makespan
    return {"ours": ours, "theirs": theirs, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--cases", nargs="+", default=list(CASES))
    args = parser.parse_args()
    print(f"torch {torch.__version__}; model {CONFIG}; m = 2 × ranks; median of steps 2..{args.steps}")
    print(f"{'schedule':<12} {'ranks':>5} {'pipeloom ms':>12} {'torch ms':>9} {'ratio':>6} {'simulated ms':>13}")
    for world in args.ranks:
        for case in args.cases:
            r = run_case(case, world, args.steps)
            print(
                f"{case:<12} {world:>5} {r['ours'] * 1e3:>12.1f} {r['theirs'] * 1e3:>9.1f} "
                f"{r['ours'] / r['theirs']:>6.3f} {r['predicted'] * 1e3:>13.1f}"
            )


if __name__ == "__main__":
    main()
