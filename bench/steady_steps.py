"""How far a plan's measured step moves from one set of rounds to the next: over all steps, and
over the steady ones only (`profile.steadiness.steady_steps`, what the profile and bench/fidelity.py use).

Runs 1F1B of examples/tiny-llama.json (2 stages of 4 layers, micro-batch 2) for `--seconds`,
one run of `--steps` steps after another, then groups the runs as the profile's probes and the
fidelity bench's plans take their rounds — `--rounds` runs spread evenly over the whole time —
and prints, for both estimators (the median of the rounds' medians), their mean over the groups
and their coefficient of variation across them (ms and %): the noise a prediction is judged
against. Also prints each run's median step, to show the machine's slow spells.
Usage: python bench/steady_steps.py [--seconds 200] [--steps 8] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from itertools import compress
from pathlib import Path

from pipeloom.models.llama import llama_config
from pipeloom.profile.steadiness import steady_rounds, step_busy, timed_steps
from pipeloom.runtime.local import run_local
from pipeloom.runtime.training import TrainSpec
from pipeloom.schedules.registry import build_schedule
from pipeloom.tune.presets import load_model

MODEL = Path(__file__).resolve().parent.parent / "examples" / "tiny-llama.json"


def estimate(runs: list[dict], steady: bool) -> float:
    """The median of the runs' median steps, over every step or the steady ones."""
    kept = steady_rounds([run["busy"] for run in runs]) if steady else [[True] * len(run["step"]) for run in runs]
    medians = [statistics.median(compress(run["step"], flags)) for run, flags in zip(runs, kept) if any(flags)]
    return statistics.median(medians)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=200.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    model = load_model(MODEL)
    spec = TrainSpec(
        build_schedule("1f1b", 2, 4), config=llama_config(model, 8, 2), steps=args.steps, layer_counts=(4, 4)
    )
    runs, end = [], time.monotonic() + args.seconds
    while time.monotonic() < end:
        results = run_local(spec)
        runs.append(
            {
                "busy": [step_busy(timed_steps(result.records)) for result in results],
                "step": [1e3 * s for s in timed_steps(results[0].step_seconds)],
            }
        )
    print(f"{len(runs)} runs of {args.steps} steps; each run's median step (ms):")
    print("  " + " ".join(f"{statistics.median(run['step']):.0f}" for run in runs))
    stride = len(runs) // args.rounds
    if stride < 2:
        print("too few runs to compare groups: give more --seconds")
        return
    groups = [[runs[i + j * stride] for j in range(args.rounds)] for i in range(stride)]
    print(f"{len(groups)} groups of {args.rounds} rounds, each spread over the whole {args.seconds:.0f} s:")
    for steady, name in ((False, "every step"), (True, "steady steps")):
        values = [estimate(group, steady) for group in groups]
        mean, deviation = statistics.fmean(values), statistics.pstdev(values)
        print(
            f"  {name:<13} mean {mean:6.1f} ms, across groups ±{deviation:4.1f} ms ({deviation / mean:.1%}), "
            f"range {min(values):.0f}–{max(values):.0f} ms"
        )


if __name__ == "__main__":
    main()
