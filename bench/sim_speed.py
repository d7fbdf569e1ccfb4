"""How fast is the simulator? Prints figures; asserts nothing (timings never live in tests).

Cases from the planning-core issue: 1F1B and Chimera at p=32, m=64 (the Mario paper reports
~700 ms for this Chimera case; our goal is <= 70 ms), and 1F1B at p=64, m=1024 with fused
backwards and with separate B and W ops (goal >= 300k ops/s).
Usage: python bench/sim_speed.py [--repeat N]
"""

from __future__ import annotations

import argparse
import platform
import time

from pipeloom import Costs, build_schedule, simulate
from pipeloom.passes import split_backward


def best_of(repeat: int, fn) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per case; the best is reported")
    args = parser.parse_args()
    costs = Costs(F=1, B=1, W=1)
    cases = [
        ("1f1b", 32, 64, False),
        ("chimera", 32, 64, False),
        ("1f1b", 64, 1024, False),
        ("1f1b", 64, 1024, True),
    ]
    print(f"python {platform.python_version()} on {platform.machine()}, best of {args.repeat}")
    print(f"{'case':<28} {'ops':>8} {'build ms':>9} {'simulate ms':>12} {'ops/s':>10}  makespan")
    for name, p, m, split in cases:
        build_s, schedule = best_of(args.repeat, lambda n=name, p=p, m=m: build_schedule(n, p, m))
        if split:
            schedule = split_backward(schedule)
        sim_s, timeline = best_of(args.repeat, lambda s=schedule: simulate(s, costs))
        label = f"{name} p={p} m={m}" + (" B+W" if split else " fused")
        print(
            f"{label:<28} {schedule.num_ops:>8} {build_s * 1e3:>9.1f} {sim_s * 1e3:>12.1f} "
            f"{schedule.num_ops / sim_s:>10,.0f}  {timeline.makespan:g}"
        )


if __name__ == "__main__":
    main()
