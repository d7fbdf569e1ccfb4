"""MEPipe Table 3 against `svpp`: bubble ratio and peak activation memory for every (p, v, s, n)
of a grid, under the paper's assumptions (T_B = T_F, no comm, even stages).

    python bench/svpp_table3.py            # p ∈ {2,4,8}, v ∈ {1,2,3}, s ∈ {1,2,4,8}, n ∈ {1,2,4,8,16}
"""

from __future__ import annotations

import itertools

from tqdm import tqdm

from pipeloom import Costs, build_schedule, simulate

EQUAL = Costs(F=1, B=1)


def table3(p: int, v: int, s: int, n: int) -> tuple[float, float]:
    """(bubble ratio, activation memory in units of A) from MEPipe Table 3's SVPP row."""
    memory = (v * max(p, s) + min(p, s) - 1) / (v * s * p)
    if n >= p:
        return (p - 1) / (n * s * v + p - 1), memory
    idle = p - 1 + (v - 1) * max(p - s * n, 0)
    return idle / (idle + n * v * s), min(memory, n / p)


def main() -> None:
    grid = list(itertools.product([2, 4, 8], [1, 2, 3], [1, 2, 4, 8], [1, 2, 4, 8, 16]))
    misses = []
    for p, v, s, n in tqdm(grid, desc="svpp vs Table 3", unit="case"):
        timeline = simulate(build_schedule("svpp", p, n, num_chunks=v, num_slices=s, costs=EQUAL), EQUAL)
        bubble, memory = timeline.bubble_rate, max(timeline.peak_activation_memory) / p
        want_bubble, want_memory = table3(p, v, s, n)
        if abs(bubble - want_bubble) > 1e-9 or abs(memory - want_memory) > 1e-9:
            misses.append((p, v, s, n, bubble, want_bubble, memory, want_memory))
    print(f"{len(grid) - len(misses)} of {len(grid)} cases equal Table 3 in bubble and memory")
    for p, v, s, n, bubble, want_bubble, memory, want_memory in misses:
        print(
            f"  p={p} v={v} s={s} n={n}: bubble {bubble:.4f} (table {want_bubble:.4f}), "
            f"memory {memory:.4f} A (table {want_memory:.4f} A)"
        )


if __name__ == "__main__":
    main()
