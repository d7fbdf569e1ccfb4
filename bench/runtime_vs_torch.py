"""pipeloom's runtime against torch.distributed.pipelining, same model, same micro-batches.

2 and 4 ranks (gloo, one thread each), schedules 1F1B, interleaved (2 chunks) and ZB-V, model
hidden 512 so that compute dominates the messages. Each step runs once with pipeloom's executor
and once with torch's matching schedule class, alternately in one job, between barriers — both doing
the same work (the loss divided by m per micro-batch, no gradient division after the last
backward) and, for ZB-V, running torch's order on both sides; the
script prints both median step times (first step left out), the median ratio of a step's two
runs (goal ≤ 1.0), and the step time the simulator predicts from the F and B times and the p2p time measured in this run.
Usage: python bench/runtime_vs_torch.py [--steps 4] [--ranks 2 4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from pipelining_race import ping_seconds, pipeloom_executor, race, summarise, torch_order, torch_schedule_for  # noqa: I001 - bench/ is on the path
from torch.distributed import pipelining

from pipeloom import Costs, build_schedule
from pipeloom.ir.torch_csv import from_torch_csv
from pipeloom.models.llama import LlamaConfig
from pipeloom.models.workload import llama_workload
from pipeloom.runtime.boundary import TensorSpec

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

    torch_schedule, holds_first, holds_last = torch_schedule_for(
        work.build(schedule.num_stages), stages_of(rank, p), schedule.num_stages, torch_class, m, work.loss
    )
    order = torch_order(torch_schedule, name) if name == "zb-v" else None
    if order is not None:  # the same ops in the same order on both sides: torch's ZBV
        schedule = from_torch_csv(order, "zb-v (torch's order)")
    stages = work.build(schedule.num_stages)
    activation_shape = (b, CONFIG.seq_len, CONFIG.hidden)
    boundaries = [(TensorSpec(activation_shape, torch.float32),)] * schedule.num_stages
    executor, _ = pipeloom_executor(schedule, rank, stages, boundaries, work.loss)

    outcome = race(executor, torch_schedule, work.batch, m, b, steps, holds_first, holds_last)
    outcome["ping"] = ping_seconds(rank, torch.randn(activation_shape))
    outcome["order"] = order
    Path(directory, f"rank{rank}.json").write_text(json.dumps(outcome))
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
    name, kwargs, _, _ = CASES[case]
    if results[0]["order"] is not None:
        schedule = from_torch_csv(results[0]["order"], "zb-v (torch's order)")
    else:
        schedule = build_schedule(name, world, 2 * world, **kwargs)
    return summarise(results, schedule)


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
                f"{r['ratio']:>6.3f} {r['predicted'] * 1e3:>13.1f}"
            )


if __name__ == "__main__":
    main()
