"""A run you would launch, measured on the shipped tiny LLaMA (examples/hf-llama-tiny) and the
byte-level tokens in examples/: 2 pipeline ranks (zb-v), a cosine rate, evaluation every few steps.

Prints: the training step and one evaluation batch (the schedule's forward-only twin) — measured
(median, rank 0) beside the simulator's ratio of their makespans on the model's uniform costs
(F = 1, B = 1, W = 1: a forward-only step is m forwards through the pipeline); what evaluation
and logging add to a run's wall time; the time to export a checkpoint to a transformers directory;
and resuming the step-k checkpoint under zb-v pp = 2 and 1f1b pp = 1 against the uninterrupted run
(largest relative loss difference).
Usage: python bench/launch_run.py [--steps N] [--microbatches M]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pipeloom import build_schedule
from pipeloom.costs import Costs
from pipeloom.data import TokenFile
from pipeloom.runtime import TrainSpec, export_checkpoint, hf_workload, run_local
from pipeloom.schedules.forward_only import forward_only_of
from pipeloom.sim.simulate import simulate

ROOT = Path(__file__).resolve().parents[1] / "examples"
SEQ = 64


def spec_of(schedule, steps: int, **changes) -> TrainSpec:
    data = TokenFile(ROOT / "train.bin", SEQ, 0)
    held_out = TokenFile(ROOT / "val.bin", SEQ, 0)
    work = hf_workload(ROOT / "hf-llama-tiny", microbatch_size=2, seq_len=SEQ, data=data)
    return TrainSpec(
        schedule, workload=work, steps=steps, lr=3e-3, lr_schedule="cosine", warmup_steps=1, min_lr=3e-4,
        eval_data=held_out.batch, **changes,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    m, steps, every = args.microbatches, args.steps, max(1, args.steps // 2)
    schedule = build_schedule("zb-v", 2, m)
    costs = Costs(F=1.0, B=1.0, W=1.0)
    predicted = simulate(forward_only_of(schedule), costs).makespan / simulate(schedule, costs).makespan
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        run_local(spec_of(schedule, 2))  # warm-up: the first run in a process pays for the imports
        began = time.perf_counter()
        plain = run_local(spec_of(schedule, steps))
        plain_s = time.perf_counter() - began
        began = time.perf_counter()
        full = run_local(
            spec_of(
                schedule, steps, eval_every=every, eval_batches=4, log_dir=str(scratch_dir / "logs"),
                save_every=every, save_dir=str(scratch_dir / "ck"),
            )
        )  # fmt: skip
        full_s = time.perf_counter() - began
        step_ms = 1e3 * statistics.median(full[0].step_seconds[1:])
        batch_ms = 1e3 * statistics.median(full[0].eval_seconds) / 4
        print(f"zb-v p=2 m={m}, tiny LLaMA (seq {SEQ}), {steps} steps, evaluation every {every} (4 batches)")
        print(f"  training step        {step_ms:8.1f} ms (median)")
        print(
            f"  evaluation batch     {batch_ms:8.1f} ms  = {batch_ms / step_ms:.2f} of a step (simulated {predicted:.2f})"
        )
        print(f"  run wall time        {full_s:8.2f} s with evaluation, logs and checkpoints; {plain_s:.2f} s without")
        print(f"  validation loss      {full[0].eval_losses[0][1]:.4f} → {full[0].eval_losses[-1][1]:.4f}")
        same = "the same" if plain[0].losses == full[0].losses else "NOT the same"
        print(f"  training losses      {same} with and without evaluation, logs and checkpoints")
        began = time.perf_counter()
        export_checkpoint(scratch_dir / "ck" / f"step-{every}", scratch_dir / "hf")
        size = sum(p.stat().st_size for p in (scratch_dir / "hf").iterdir())
        print(f"  export step-{every}        {time.perf_counter() - began:8.2f} s  ({size / 2**20:.2f} MiB)")
        for other in (build_schedule("zb-v", 2, m), build_schedule("1f1b", 1, m)):
            resumed = run_local(spec_of(other, steps, resume_dir=str(scratch_dir / "ck" / f"step-{every}")))
            worst = max(abs(a - b) / abs(b) for a, b in zip(resumed[0].losses, full[0].losses[every:]))
            print(f"  resume under {other.name:5s} p={other.num_devices}: losses within {worst:.1e} of the run")


if __name__ == "__main__":
    main()
