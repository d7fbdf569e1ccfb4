"""Mario: checkpointing tessellated into bubbles, across the V, X and W shapes.

For 1F1B (V), Chimera (X) and interleaved with two chunks (W), p ∈ {4, 8, 16, 32},
m ∈ {p, 2p, 4p}, B/F ∈ {1.6, 2}, R = F, comm = 0.02·F and a kept input of 1 % of a stage's
activations, this prints the makespan of the plain schedule, of full checkpointing (recompute
inside the backward) and of Mario — at its default target (one activation per device) and with
half of the plain schedule's peak as a memory limit — as ratios to the plain makespan, with the
largest peak activation memory and its max/min across devices, and Mario's wall time.
Goal: Mario ≤ 1.05 × plain at m = p. Usage: python bench/mario.py [--p 4 8] [--ratio 2]
"""

from __future__ import annotations

import argparse
import platform
import time

from pipeloom import Costs, build_schedule, simulate
from pipeloom.passes import apply_checkpoint, mario

SHAPES = [("V", "1f1b", {}), ("X", "chimera", {}), ("W", "interleaved", {"num_chunks": 2})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--ratio", type=float, nargs="+", default=[1.6, 2.0], help="B/F")
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}")
    print("makespan / plain; peak = largest peak activation memory (M_B of one device's share), spread = max/min")
    header = (
        f"{'shape':<5} {'p':>3} {'m':>4} {'B/F':>4} {'plain':>8} {'full':>6} {'mario':>6} {'peak':>6} "
        f"{'spread':>6} {'@half':>6} {'peak':>6} {'plain peak':>10} {'mario s':>8}"
    )
    print(header)
    for ratio in args.ratio:
        costs = Costs(F=1.0, B=ratio, R=1.0, comm=0.02, M_B=1.0, M_ckpt=0.01)
        for shape, name, kwargs in SHAPES:
            for p in args.p:
                for m in (p, 2 * p, 4 * p):
                    plain_schedule = build_schedule(name, p, m, **kwargs)
                    plain = simulate(plain_schedule, costs)
                    full = simulate(apply_checkpoint(plain_schedule), costs)
                    began = time.perf_counter()
                    tessellated = simulate(mario(plain_schedule, costs), costs)
                    seconds = time.perf_counter() - began
                    half = max(plain.peak_activation_memory) / 2
                    limited = simulate(mario(plain_schedule, costs, mem_limit=half), costs)
                    peaks = tessellated.peak_activation_memory
                    print(
                        f"{shape:<5} {p:>3} {m:>4} {ratio:>4g} {plain.makespan:>8.1f} "
                        f"{full.makespan / plain.makespan:>6.3f} {tessellated.makespan / plain.makespan:>6.3f} "
                        f"{max(peaks):>6.2f} {max(peaks) / min(peaks):>6.2f} "
                        f"{limited.makespan / plain.makespan:>6.3f} {max(limited.peak_activation_memory):>6.2f} "
                        f"{max(plain.peak_activation_memory):>10.2f} {seconds:>8.2f}"
                    )


if __name__ == "__main__":
    main()
