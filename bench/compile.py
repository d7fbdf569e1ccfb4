"""`--compile` against eager on this machine's CPU: step time of 1f1b and zb-v on the tiny HF LLaMA.

Each schedule runs in one process (`run_in_process`, one thread a rank), eager and then compiled,
on the real text of examples/train.bin. The first steps compile (their wall time is printed
apart); the step time is the median of the steps after them. On a CPU inductor gains little over
eager for a model this small (its C++ kernels against oneDNN's GEMMs), so the figure is for the
record; the GPU's is `bench/gpu.py`'s.

Usage: python bench/compile.py [--steps 8] [--microbatch-size 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pipeloom import build_schedule
from pipeloom.data import TokenFile
from pipeloom.models.hf import hf_workload
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.training import TrainSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WARM = 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8, help="measured steps after the warm-up")
    parser.add_argument("--microbatch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    data = TokenFile(EXAMPLES / "train.bin", args.seq_len, seed=0)
    work = hf_workload(EXAMPLES / "hf-llama-tiny", 0, args.microbatch_size, args.seq_len, data=data)
    print(
        f"tiny HF LLaMA (examples/hf-llama-tiny), p 2, 8 micro-batches of {args.microbatch_size} × {args.seq_len} "
        f"tokens, fp32, CPU, one thread a rank; median of {args.steps} steps after {WARM}\n"
    )
    print(f"{'schedule':<8} {'eager ms':>9} {'compiled ms':>12} {'compiled/eager':>15} {'warm-up s (compiled)':>21}")
    for name in ("1f1b", "zb-v"):
        times = {}
        for compiled in (False, True):
            spec = TrainSpec(build_schedule(name, 2, 8), workload=work, steps=WARM + args.steps, compile=compiled)
            began = time.perf_counter()
            result = run_in_process(spec)[0]
            times[compiled] = (statistics.median(result.step_seconds[WARM:]), sum(result.step_seconds[:WARM]))
            times[compiled] += (time.perf_counter() - began,)
        eager, compiled_ = times[False][0], times[True][0]
        print(
            f"{name:<8} {eager * 1e3:>9.1f} {compiled_ * 1e3:>12.1f} {compiled_ / eager:>15.3f} {times[True][1]:>21.1f}"
        )


if __name__ == "__main__":
    main()
