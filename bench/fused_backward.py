"""A fused backward priced as measured, against the same plan priced as a B and its W apart.

The runtime runs a W inside its B wherever nothing would run between them (every W of a device
alone in its pipeline, a W right after its B): one autograd pass, its micro-batch's forward with
ordinary linears. The profile times that pass (BW) and that forward (F_BW) on one probe
micro-batch, and `tune` prices such plans by them. Here each flow is profiled once, tuned for a
one-device plan (every backward fused) and a two-stage zb-h1 plan (its first device's fused),
and each plan run `--runs` times by `train --plan`; every run's measured pipeline is set beside
the plan's prediction and beside the same schedule simulated with the fused ops priced as before
they were measured (B + W, and F). Both predictions face the same run, so the machine's drift
moves both alike: what differs is the fused ops' price.

    python bench/fused_backward.py [--flows tiny-llama hf-llama] [--runs 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from pipeloom.costs import Costs  # noqa: E402
from pipeloom.ir.schedule import Schedule  # noqa: E402
from pipeloom.sim.simulate import simulate  # noqa: E402

FLOWS = {  # each profiled at the layers a stage its plans hold (8 and 4 layers: 4 and 2 a stage), none extrapolated
    "tiny-llama": ["--model", str(ROOT / "examples" / "tiny-llama.json"), "--layers", "2,4"],
    "hf-llama": ["--model", f"hf:{ROOT / 'examples' / 'hf-llama-tiny'}", "--seq-len", "128", "--layers", "1,2"],
}
PLANS = {"pp=1 zb-v": ["--pp", "1", "--schemes", "zb-v"], "pp=2 zb-h1": ["--pp", "2", "--schemes", "zb-h1"]}
_PIPELINE = re.compile(r"^\s*pipeline\s+([\d.]+) ms\s+vs\s+([\d.]+) ms", re.M)


def pipeloom(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "pipeloom", *args], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pipeloom {' '.join(args)} failed: {done.stderr.strip()[-400:]}")
    return done.stdout


def fused_saving(plan_path: Path) -> float:
    """How much shorter (ms) the plan's pipeline simulates priced as measured than with its fused
    ops priced as B + W and F."""
    plan = json.loads(plan_path.read_text())
    schedule, costs = Schedule.from_dict(plan["schedule"]), Costs.from_mapping(plan["costs"])
    apart = dataclasses.replace(costs, BW=None, F_BW=None)
    return simulate(schedule, apart).makespan - simulate(schedule, costs).makespan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flows", nargs="+", choices=sorted(FLOWS), default=list(FLOWS))
    parser.add_argument("--runs", type=int, default=3, help="train --plan runs of each plan (default 3)")
    args = parser.parse_args()
    print(
        f"{'flow':<11} {'plan':<11} {'measured ms':>11} {'fused priced':>13} {'error':>7} {'apart priced':>13} {'error':>7}"
    )
    for flow in args.flows:
        with tempfile.TemporaryDirectory(prefix="pipeloom-fused-") as directory:
            where = Path(directory)
            pipeloom("profile", *FLOWS[flow], "--mbs", "2", "--output", "profile.json", cwd=where)
            for name, flags in PLANS.items():
                plan = where / f"{name.replace(' ', '-')}.json"
                tune = ["tune", "--costs", "profile.json", "--devices", "2", "--memory", "1GiB", "--global-batch", "8"]
                pipeloom(
                    *tune,
                    "--max-mbs",
                    "2",
                    *flags,
                    "--output",
                    str(plan),
                    "--plot",
                    str(plan.with_suffix(".png")),
                    cwd=where,
                )
                saving = fused_saving(plan)
                measured, fused = [], 0.0
                for _ in range(args.runs):
                    found = _PIPELINE.search(pipeloom("train", "--plan", str(plan), cwd=where))
                    if found is None:
                        raise SystemExit("train --plan printed no pipeline line")
                    fused = float(found[1])  # the plan's predicted pipeline, its speed noise included
                    measured.append(float(found[2]))
                middle, apart = statistics.median(measured), fused + saving
                print(
                    f"{flow:<11} {name:<11} {middle:>11.1f} {fused:>13.1f} {middle / fused - 1:>+7.1%} "
                    f"{apart:>13.1f} {middle / apart - 1:>+7.1%}   (runs: {', '.join(f'{m:.1f}' for m in measured)})",
                    flush=True,
                )


if __name__ == "__main__":
    main()
