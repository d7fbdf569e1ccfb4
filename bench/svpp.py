"""Slice-level pipelines (MEPipe): SVPP and TeraPipe against DAPPLE, VPP and ZB-1p.

Llama-13B-like costs per device share and micro-batch (40 layers, 4K tokens): F = 1, B = 1 (input
gradient), W = 1 (weight gradient; fused BW = 2), comm = 0.01, attention 10 % of F and B time
(so later slices cost more), M_B = 1 and M_W = 0.5. p = 8; s ∈ {1, 2, 4, 8}, n ∈ {4, 8, 16},
v ∈ {1, 2}. For each it prints the bubble ratio and the peak activation memory (in A, one
micro-batch through the whole model) of the schemes, and SVPP with weight-gradient parts (7 per
layer) with its speed-up (MEPipe reports +9.4 %). Goal: for n < p, SVPP within the memory of the
best non-sliced schedule has at most half its bubble ratio.
Usage: python bench/svpp.py [--p 8] [--n 4 8 16] [--s 1 2 4 8]
"""

from __future__ import annotations

import argparse
import platform
import time

from pipeloom import Costs, build_schedule, simulate
from pipeloom.errors import PipeloomError
from pipeloom.passes import weight_parts

COSTS = Costs(F=1.0, B=1.0, W=1.0, comm=0.01, M_B=1.0, M_W=0.5, attention_fraction=0.10)
LAYERS = 40


def describe(timeline, p: int) -> str:
    return f"{timeline.bubble_rate:>6.3f} {max(timeline.peak_activation_memory) / p:>5.3f}"


def baselines(p: int, n: int):
    """The non-sliced schedules: (name, timeline)."""
    out = [("DAPPLE", simulate(build_schedule("1f1b", p, n), COSTS))]
    for v in (2,):
        try:
            out.append((f"VPP v={v}", simulate(build_schedule("interleaved", p, n, num_chunks=v), COSTS)))
        except PipeloomError:
            pass  # n > p and not a multiple of p
    out.append(("ZB-1p", simulate(build_schedule("zb-1p", p, n, costs=COSTS), COSTS)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=8)
    parser.add_argument("--n", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--s", type=int, nargs="+", default=[1, 2, 4, 8])
    args = parser.parse_args()
    p = args.p
    print(f"python {platform.python_version()} on {platform.machine()}; p={p}; columns: bubble ratio, peak memory (A)")
    gains = []
    for n in args.n:
        print(f"\nn={n}" + ("  (n < p: the large-cluster regime)" if n < p else ""))
        base = baselines(p, n)
        for name, timeline in base:
            print(f"  {name:<28} {describe(timeline, p)}")
        best_name, best = min(base, key=lambda item: item[1].bubble_rate)
        budget = max(best.peak_activation_memory)
        for s in args.s:
            tera = simulate(build_schedule("terapipe", p, n, num_slices=s), COSTS)
            print(f"  {f'TeraPipe s={s}':<28} {describe(tera, p)}")
            for v in (1, 2):
                began = time.perf_counter()
                schedule = build_schedule("svpp", p, n, num_chunks=v, num_slices=s, costs=COSTS)
                seconds = time.perf_counter() - began
                plain = simulate(schedule, COSTS)
                parts = max(1, round(7 * LAYERS / (v * p)))
                parted = simulate(weight_parts(schedule, COSTS, parts=parts), COSTS)
                gain = plain.makespan / parted.makespan - 1
                gains.append(gain)
                line = (
                    f"  {f'SVPP v={v} s={s}':<28} {describe(plain, p)}   + W parts {describe(parted, p)}"
                    f"  speed-up {gain:+.1%}   ({seconds:.2f} s)"
                )
                if n < p:
                    within = build_schedule("svpp", p, n, num_chunks=v, num_slices=s, costs=COSTS, mem_limit=budget)
                    fitted = simulate(weight_parts(within, COSTS, parts=parts), COSTS)
                    ratio = fitted.bubble_rate / best.bubble_rate
                    verdict = "goal met" if ratio <= 0.5 else "goal missed"
                    line += f"\n  {'':<28} within {best_name}'s memory, with W parts: bubble {fitted.bubble_rate:.3f} = {ratio:.2f} × {best_name}'s  {verdict}"
                print(line)
    print(f"\nweight parts: mean speed-up {sum(gains) / len(gains):+.1%} over {len(gains)} SVPP configurations")


if __name__ == "__main__":
    main()
