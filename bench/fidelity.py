"""Predicted vs measured: plans tuned from a profile of this machine, then run with the runtime.

Profiles examples/tiny-llama.json (micro-batch sizes 1, 2, 4; 1, 2, 4 layers per stage), tunes one
plan per scheme on 2 ranks (global batch 8, micro-batch ≤ 2) plus one under a memory limit that
only checkpointing meets, trains each for 8 steps (the first left out) and prints predicted and
measured step time and peak activation (stash) bytes per device, and their mean absolute
percentage errors. Goal: MAPE ≤ 5 % for time, ≤ 2 % for memory (Mario reports 9.4 % and 5.1 %).
Usage: python bench/fidelity.py [--profile profile.json] [--steps 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
from pathlib import Path

from pipeloom.profile.profiler import llama_config, profile_model
from pipeloom.runtime.local import run_local
from pipeloom.runtime.training import TrainSpec
from pipeloom.tune.plan import plan_from_evaluation
from pipeloom.tune.presets import load_model
from pipeloom.tune.profiled import ProfiledCostModel
from pipeloom.tune.search import tune

MODEL = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama.json"
PLANS = [  # (what it shows, tune keyword arguments)
    ("1f1b", {"schemes": ["1f1b"]}),
    ("zb-h1", {"schemes": ["zb-h1"]}),
    ("interleaved", {"schemes": ["interleaved"]}),
    ("chimera", {"schemes": ["chimera"]}),
    ("zb-v", {"schemes": ["zb-v"]}),
    ("tpipe", {"schemes": ["tpipe"]}),
    ("1f1b, memory-short", {"schemes": ["1f1b"], "memory_factor": 0.6}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="reuse a profile instead of measuring one")
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    model = load_model(MODEL)
    if args.profile:
        profile = json.loads(Path(args.profile).read_text())
    else:
        profile = profile_model(model, micro_batches=(1, 2, 4), layer_counts=(1, 2, 4), steps=5)
    cost_model = ProfiledCostModel(profile)
    print(f"python {platform.python_version()} on {platform.machine()}; {model.name}, 2 ranks, {args.steps} steps")
    print(f"{'plan':<44} {'step ms':>9} {'measured':>9} {'error':>7}   {'stash MiB (pred / meas) per device':<36}")
    time_errors, memory_errors = [], []
    for _, options in PLANS:
        options = dict(options)
        memory = 2**30
        if "memory_factor" in options:  # static memory plus a share of the plain plan's activations
            plain = tune(cost_model, 2, memory, 8, pp_values=[2], micro_batches=[1, 2], schemes=options["schemes"])
            activations = max(plain.best.timeline.peak_activation_memory)
            memory = max(plain.best.static_memory) + options.pop("memory_factor") * activations
        result = tune(cost_model, 2, memory, 8, pp_values=[2], micro_batches=[1, 2], **options)
        plan = plan_from_evaluation(result.best, result, model, cost_model.to_dict(), 1)
        spec = TrainSpec(
            plan.schedule,
            config=llama_config(model, model.layers, plan.micro_batch_size),
            dp=plan.dp,
            steps=args.steps,
            layer_counts=plan.partition,
        )
        results = run_local(spec)
        measured = 1e3 * statistics.median(results[0].step_seconds[1:])
        predicted = plan.predicted["step_time_ms"]
        time_errors.append(abs(measured - predicted) / measured)
        cells = []
        for device, expected in enumerate(plan.predicted["peak_activation_memory"]):
            stash = max(r.peak_stash_bytes for r in results[device].records)
            memory_errors.append(abs(stash - expected) / stash)
            cells.append(f"{expected / 2**20:.1f}/{stash / 2**20:.1f}")
        print(
            f"{result.best.candidate.label:<44} {predicted:>9.1f} {measured:>9.1f} {measured / predicted - 1:>+7.1%}   "
            + "  ".join(cells)
        )
    time_mape, memory_mape = statistics.fmean(time_errors), statistics.fmean(memory_errors)
    print(
        f"\nMAPE: step time {time_mape:.1%} (goal ≤ 5%: {'met' if time_mape <= 0.05 else 'missed'}), "
        f"memory {memory_mape:.2%} (goal ≤ 2%: {'met' if memory_mape <= 0.02 else 'missed'})"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as handle:
        json.dump(profile, handle)
        print(f"profile kept at {handle.name} (--profile to reuse)")


if __name__ == "__main__":
    main()
