"""`--compile` against eager on this machine's CPU: step time of 1f1b and zb-v on the tiny HF LLaMA.

Each schedule runs in one process (`run_in_process`, one thread a rank), eager and then compiled,
on the real text of examples/train.bin. The first steps compile (their wall time is printed
apart); the step time is the median of the steps after them. For zb-v, whose W is deferred, a
third run compiles the other way the split backward could survive compilation: regions between
the linears, each split linear a graph break running eagerly (`torch.compiler.disable`) —
against pipeloom's custom op, one graph a stage. On a CPU inductor gains little over eager for a
model this small, so the figures are for the record; the GPU's are `bench/gpu.py`'s.

Usage: python bench/compiled_stages.py [--steps 8] [--microbatch-size 4] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

import torch

from pipeloom import build_schedule
from pipeloom.data import TokenFile
from pipeloom.models.hf import hf_workload
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.split_linear import SplitLinear
from pipeloom.runtime.training import TrainSpec

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WARM = 2
RUNS = [  # schedule, label, compiled, a graph break at each split linear
    ("1f1b", "eager", False, False),
    ("1f1b", "compiled", True, False),
    ("zb-v", "eager", False, False),
    ("zb-v", "compiled (custom op: one graph a stage)", True, False),
    ("zb-v", "compiled, a graph break at each linear", True, True),
]


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
    print(f"{'schedule':<8} {'run':<40} {'step ms':>8} {'× eager':>8} {'warm-up s':>10}")
    eager: dict[str, float] = {}
    for name, label, compiled, breaks in RUNS:
        spec = TrainSpec(build_schedule(name, 2, 8), workload=work, steps=WARM + args.steps, compile=compiled)
        with graph_breaks_at_split_linears() if breaks else contextlib.nullcontext():
            result = run_in_process(spec)[0]
        step = statistics.median(result.step_seconds[WARM:])
        eager.setdefault(name, step)
        warm = sum(result.step_seconds[:WARM])
        print(f"{name:<8} {label:<40} {step * 1e3:>8.1f} {step / eager[name]:>8.3f} {warm:>10.1f}")


@contextlib.contextmanager
def graph_breaks_at_split_linears():
    """Split linears as graph breaks: the compiled stage runs in regions between them."""
    forward = SplitLinear.forward
    SplitLinear.forward = torch.compiler.disable(forward)  # type: ignore[method-assign]
    try:
        yield
    finally:
        SplitLinear.forward = forward  # type: ignore[method-assign]
        torch._dynamo.reset()


if __name__ == "__main__":
    main()
