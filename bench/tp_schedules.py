"""Every schedule that splits the backward, trained with tensor parallelism, against one process.

pp = 2 × tp = 2 gloo ranks (4 forked processes) train the shipped Hugging Face LLaMA config
(examples/hf-llama-tiny: grouped-query attention, tied embeddings) for two steps; each row prints the last loss's relative difference
from single-process training and how far the worst gathered parameter lies beyond rtol 1e-5
(≤ 1e-6 is within the tests' atol). lr is 1e-5: AdamW turns a rounding difference δ in a near-zero
gradient into up to lr·δ/1e-8 of a weight (see tests/runtime/test_tensor_parallel.py).
Usage: python bench/tp_schedules.py
"""

from __future__ import annotations

from pathlib import Path

from pipeloom import build_schedule
from pipeloom.costs import Costs
from pipeloom.passes import apply_checkpoint
from pipeloom.passes.weight_parts import weight_parts
from pipeloom.runtime import TrainSpec, hf_workload, reference_training, run_local

MODEL = Path(__file__).resolve().parent.parent / "examples" / "hf-llama-tiny"


def main() -> None:
    work = hf_workload(MODEL, seed=1, microbatch_size=2, seq_len=16)
    rows = [
        ("zb-h1 + sp", build_schedule("zb-h1", 2, 4), {"sequence_parallel": True}),
        ("zb-h2", build_schedule("zb-h2", 2, 4), {}),
        ("zb-auto", build_schedule("zb-auto", 2, 4), {}),
        ("zb-v", build_schedule("zb-v", 2, 4), {}),
        ("v-half", build_schedule("v-half", 2, 4), {}),
        ("v-min", build_schedule("v-min", 2, 4), {}),
        ("dualpipev", build_schedule("dualpipev", 2, 4), {}),
        ("1f1b + W parts (3)", weight_parts(build_schedule("1f1b", 2, 4), Costs(F=1, B=1, W=1), parts=3), {}),
        ("1f1b checkpointed + sp", apply_checkpoint(build_schedule("1f1b", 2, 4)), {"sequence_parallel": True}),
        ("zb-h1 checkpointed, 1 layer", apply_checkpoint(build_schedule("zb-h1", 2, 4)), {"recompute_layers": 1}),
        ("zb-h1 dp 2 ZeRO-2 + sp", build_schedule("zb-h1", 2, 4), {"dp": 2, "zero": 2, "sequence_parallel": True}),
        ("1f1b dp 2 offload stage 1", build_schedule("1f1b", 2, 4), {"dp": 2, "offload_stages": (1,)}),
    ]
    print(f"{'schedule (pp 2 × tp 2)':<30} {'loss rel':>9} {'param excess':>13}  within")
    for label, schedule, options in rows:
        spec = TrainSpec(schedule, workload=work, lr=1e-5, tp=2, **options)
        results = run_local(spec, timeout_s=120)
        losses, expected = reference_training(spec)
        worst = max(
            float(((value - expected[stage][name]).abs() - 1e-5 * expected[stage][name].abs()).max())
            for result in results
            for stage, parameters in result.parameters.items()
            for name, value in parameters.items()
        )
        rel = abs(results[0].losses[-1] / losses[-1] - 1)
        print(f"{label:<30} {rel:>9.1e} {worst:>13.1e}  {'yes' if worst <= 1e-6 else 'NO'}")


if __name__ == "__main__":
    main()
