"""What a split backward costs where there is no bubble to fill: p = 1, 1f1b against zb-h1.

At p = 1 zb-h1 runs each micro-batch's W right after its B: nothing waits for the B's result
sooner, so the runtime folds that W into the B (the linears' weight gradients come out of the
backward as autograd computes them). `separate_w` keeps every W its own op, as the profiler
times them: then the linears save their inputs and output gradients for the W and it runs
their GEMMs after the B. The table splits each step into its ops' time by kind (host clocks:
this is a CPU). Tiny HF LLaMA (examples/hf-llama-tiny) on examples/train.bin, fp32, one thread.

Usage: python bench/split_backward.py [--steps 8] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pipeloom import build_schedule
from pipeloom.data import TokenFile
from pipeloom.models.hf import hf_workload
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.training import TrainSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WARM = 2
RUNS = {  # label -> (schedule, keep every W apart)
    "1f1b": ("1f1b", False),
    "zb-h1, W folded into B": ("zb-h1", False),
    "zb-h1, every W apart": ("zb-h1", True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each, taken in turns")
    args = parser.parse_args()
    data = TokenFile(EXAMPLES / "train.bin", 128, seed=0)
    work = hf_workload(EXAMPLES / "hf-llama-tiny", 0, 4, 128, data=data)
    steps: dict[str, list[float]] = {label: [] for label in RUNS}
    kinds: dict[str, dict[str, list[float]]] = {label: {} for label in RUNS}
    for _ in range(args.repeats):
        for label, (name, apart) in RUNS.items():
            schedule = build_schedule(name, 1, 8)
            kind_of = {op.text: op.kind.value for op in schedule.devices[0]}
            spec = TrainSpec(schedule, workload=work, steps=WARM + args.steps, separate_w=apart)
            result = run_in_process(spec)[0]
            steps[label] += result.step_seconds[WARM:]
            for record in result.records[WARM:]:
                per_kind: dict[str, float] = {}
                for text, began, ended in record.ops:
                    per_kind[kind_of[text]] = per_kind.get(kind_of[text], 0.0) + ended - began
                for kind, seconds in per_kind.items():
                    kinds[label].setdefault(kind, []).append(seconds)
    base = statistics.median(steps["1f1b"])
    print(f"p 1, 8 micro-batches of 4 × 128 tokens, fp32, CPU; medians of {args.repeats} × {args.steps} steps\n")
    print(f"{'run':<24} {'step ms':>8} {'× 1f1b':>7} {'F ms':>7} {'B ms':>7} {'W ms':>7} {'BW ms':>7}")
    for label in RUNS:
        step = statistics.median(steps[label])
        cells = [statistics.median(kinds[label][k]) * 1e3 if k in kinds[label] else None for k in "F B W BW".split()]
        text = " ".join(f"{c:>7.1f}" if c is not None else f"{'—':>7}" for c in cells)
        print(f"{label:<24} {step * 1e3:>8.1f} {step / base:>7.3f} {text}")


if __name__ == "__main__":
    main()
