"""Slices in the runtime: peak stash bytes and step time of 1F1B against SVPP (s = 2, 4).

Same LLaMA-style model (hidden 256, 4 layers, sequence 256, micro-batch 2) and data on 2 ranks
(gloo, one thread each), 4 micro-batches, 4 steps (the first left out). SVPP runs Table 3's
variant (f = max(p,s) + min(p,s) − 1 forwards before the first backward). For each it prints the
peak stash per device, measured against 1F1B's, and the simulator's prediction of that ratio from
the bytes one forward of each stage and slice stashed in this run; and the median step time.
Usage: python bench/slices.py [--steps 4]
"""

from __future__ import annotations

import argparse
import platform
import statistics

from pipeloom import Costs, build_schedule, simulate
from pipeloom.models.llama import LlamaConfig
from pipeloom.runtime.local import run_local
from pipeloom.runtime.training import TrainSpec
from pipeloom.schedules.svpp import table3_forwards

CONFIG = LlamaConfig(vocab=512, hidden=256, layers=4, heads=4, ffn=512, seq_len=256, microbatch_size=2)
P, M = 2, 4


def entry_bytes(results, slices: int) -> list[list[int]]:
    """Per stage (= device here) and slice: what one forward stashed."""
    return [
        [results[d].records[-1].entry_bytes[f"{d}F0.{s}" if s else f"{d}F0"] for s in range(slices)] for d in range(P)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}; hidden 256, sequence 256, p=2, m=4")
    plain_schedule = build_schedule("1f1b", P, M)
    plain = run_local(TrainSpec(plain_schedule, config=CONFIG, steps=args.steps))
    plain_peak = [max(r.peak_stash_bytes for r in plain[d].records) for d in range(P)]
    plain_predicted = simulate(plain_schedule, Costs(M_B=[b[0] for b in entry_bytes(plain, 1)])).peak_activation_memory
    print(
        f"{'schedule':<12} {'peak stash MiB per device':<28} {'measured/1F1B':<16} {'predicted/1F1B':<16} {'step ms':>8}"
    )
    rows = [("1f1b", plain_schedule, plain, 1)]
    for slices in (2, 4):
        schedule = build_schedule("svpp", P, M, num_slices=slices, forwards=table3_forwards(P, 1, slices))
        rows.append(
            (f"svpp s={slices}", schedule, run_local(TrainSpec(schedule, config=CONFIG, steps=args.steps)), slices)
        )
    for name, schedule, results, slices in rows:
        peaks = [max(r.peak_stash_bytes for r in results[d].records) for d in range(P)]
        predicted = simulate(schedule, Costs(M_B=entry_bytes(results, slices))).peak_activation_memory
        step = 1e3 * statistics.median(results[0].step_seconds[1:])
        print(
            f"{name:<12} {' '.join(f'{p / 2**20:.2f}' for p in peaks):<28} "
            f"{' '.join(f'{p / q:.3f}' for p, q in zip(peaks, plain_peak)):<16} "
            f"{' '.join(f'{p / q:.3f}' for p, q in zip(predicted, plain_predicted)):<16} {step:>8.1f}"
        )


if __name__ == "__main__":
    main()
