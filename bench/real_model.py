"""A ~100M-parameter LLaMA-style Hugging Face model on a token file (and torchvision's ResNet-152):
pipeloom against torch.distributed.pipelining, same model, schedule and micro-batches, in one run.

The model is transformers' LlamaForCausalLM (hidden 768, 12 layers, SwiGLU 2048, 12 heads,
vocabulary 8192: about 100M parameters), built from a config.json written here; the data is a
flat uint16 token file made from text this machine ships (the Python license and standard-library
docstrings), tokenized by a byte-level BPE trained on it. Both runtimes get the same stage
modules (pipeloom's cut of the model) and the same micro-batches, do the same work (the loss
divided by m per micro-batch, no gradient division after the last backward; for ZB-V torch's own
order on both sides) and alternate step by step on the same ranks. Printed: median step time and tokens/s of each, the median ratio of a step's two runs
(goal ≤ 1.0), and the step
the simulator predicts from the op times pipeloom measured (predicted vs measured).

`--model resnet152` runs torchvision's ResNet-152 (2BP's CNN) on synthetic 64×64 images instead,
cut into balanced runs of its residual blocks; throughput is then in images/s.

    python bench/real_model.py [--model llama|resnet152] [--steps 9] [--seq-len 128] [--microbatches 4]
                               [--schedules 1f1b zb-v]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from pipelining_race import ping_seconds, pipeloom_executor, race, summarise, torch_order, torch_schedule_for  # noqa: I001 - bench/ is on the path
from torch.distributed import pipelining

from pipeloom import Costs, build_schedule
from pipeloom.data import TextTokens, sample_corpus, train_tokenizer
from pipeloom.ir.torch_csv import from_torch_csv
from pipeloom.models.hf import hf_workload
from pipeloom.models.vision import resnet_workload
from pipeloom.runtime.boundary import probe_stages
from pipeloom.runtime.executor import run_stage
from pipeloom.runtime.precision import Precision

CONFIG = {
    "model_type": "llama",
    "vocab_size": 8192,
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "max_position_embeddings": 1024,
}
CASES = {  # pipeloom generator -> (kwargs, torch schedule class, stages of rank d)
    "1f1b": ({}, pipelining.Schedule1F1B, lambda d, p: [d]),
    "zb-v": ({"costs": Costs(F=1, B=1, W=1)}, pipelining.ScheduleZBVZeroBubble, lambda d, p: [d, 2 * p - 1 - d]),
}


def _rank(rank: int, world: int, directory: str, args, case: str) -> None:
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store-{case}", rank=rank, world_size=world)
    kwargs, torch_class, stages_of = CASES[case]
    p, m, b = world, args.microbatches, args.microbatch_size
    schedule = build_schedule(case, p, m, **kwargs)
    if args.model == "llama":
        data = TextTokens(Path(directory, "corpus.txt"), Path(directory, "tokenizer"), args.seq_len, seed=0)
        work = hf_workload(Path(directory, "model"), seed=0, microbatch_size=b, seq_len=args.seq_len, data=data)
    else:
        work = resnet_workload(args.model, microbatch_size=b, image_size=args.image_size)

    theirs_modules = work.build(schedule.num_stages)
    torch_schedule, holds_first, holds_last = torch_schedule_for(
        theirs_modules, stages_of(rank, p), schedule.num_stages, torch_class, m, work.loss
    )
    order = torch_order(torch_schedule, case) if case == "zb-v" else None
    if order is not None:  # the same ops in the same order on both sides: torch's ZBV
        schedule = from_torch_csv(order, "zb-v (torch's order)")
    stages = work.build(schedule.num_stages)
    inputs, _ = work.batch(b, 0)
    probe = probe_stages(
        stages, (inputs,), lambda s, x: run_stage(s, x, None, Precision(), torch.device("cpu"), True)[0]
    )
    executor, own = pipeloom_executor(schedule, rank, stages, probe.boundaries, work.loss)

    outcome = race(
        executor,
        torch_schedule,
        work.batch,
        m,
        b,
        args.steps,
        holds_first,
        holds_last,
        modules=[*own, *theirs_modules],
    )
    outcome["ping"] = ping_seconds(rank, torch.empty(probe.boundaries[1][0].shape))  # what stage 0 sends
    outcome["params"] = sum(t.numel() for s in stages for t in s.parameters())
    outcome["order"] = order
    Path(directory, f"{case}-rank{rank}.json").write_text(json.dumps(outcome))
    dist.destroy_process_group()


def run_case(directory: str, args, case: str) -> dict:
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_rank, args=(r, 2, directory, args, case)) for r in range(2)]
    for process in processes:
        process.start()
    for process in processes:
        process.join()
    if any(process.exitcode for process in processes):
        raise SystemExit(f"{case} failed")
    results = [json.loads(Path(directory, f"{case}-rank{r}.json").read_text()) for r in range(2)]
    if results[0]["order"] is not None:
        schedule = from_torch_csv(results[0]["order"], "zb-v (torch's order)")
    else:
        schedule = build_schedule(case, 2, args.microbatches, **CASES[case][0])
    return {**summarise(results, schedule), "params": results[0]["params"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("llama", "resnet152", "resnet50", "resnet18"), default="llama")
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=9)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--microbatch-size", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--schedules", nargs="+", default=["1f1b", "zb-v"], choices=list(CASES))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="pipeloom-real-") as directory:
        if args.model == "llama":
            began = time.perf_counter()
            text = sample_corpus()
            Path(directory, "corpus.txt").write_text(text)
            train_tokenizer(Path(directory, "tokenizer"), text, vocab_size=CONFIG["vocab_size"])
            Path(directory, "model").mkdir()
            Path(directory, "model", "config.json").write_text(json.dumps(CONFIG))
            print(f"corpus {len(text):,} characters, tokenizer trained in {time.perf_counter() - began:.1f} s")
            tokens, unit = args.microbatches * args.microbatch_size * args.seq_len, "tok/s"
            sample = f"{args.seq_len} tokens"
        else:
            tokens, unit = args.microbatches * args.microbatch_size, "img/s"
            sample = f"{args.image_size}×{args.image_size} images"
        print(
            f"2 ranks × {args.threads} thread(s), {args.microbatches} micro-batches of {args.microbatch_size} × "
            f"{sample} ({tokens} a step), median of steps 2..{args.steps}"
        )
        print(
            f"{'schedule':<9} {'pipeloom ms':>12} {'torch ms':>9} {'pipeloom ' + unit:>15} {'torch ' + unit:>12} "
            f"{'ratio':>6} {'predicted ms':>13} {'error':>7}"
        )
        for case in args.schedules:
            r = run_case(directory, args, case)
            print(
                f"{case:<9} {r['ours'] * 1e3:>12.1f} {r['theirs'] * 1e3:>9.1f} {tokens / r['ours']:>15.1f} "
                f"{tokens / r['theirs']:>12.1f} {r['ratio']:>6.3f} {r['predicted'] * 1e3:>13.1f} "
                f"{r['predicted'] / r['ours'] - 1:>+7.1%}"
            )
        what = "transformers LlamaForCausalLM" if args.model == "llama" else f"torchvision {args.model}"
        print(f"model: {what}, {r['params'] / 1e6:.1f}M parameters")


if __name__ == "__main__":
    main()
