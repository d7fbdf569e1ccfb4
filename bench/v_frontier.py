"""The V family against its authors' schedules on Zero Bubble Table 6's profiles.

For each profile and each memory budget (p/3, p/2, 5p/8, p and 2p, in M_B) this prints the
authors' best named schedule within the budget (ZB-V at p·M_B and 2p·M_B, V-Half, V-Min; their
bubble and peak from `zb_profiles.AUTHORS_V`, obtained by running their code), then pipeloom's
`v-auto` given the authors' peak as its limit (or the budget, where no schedule of theirs fits),
with its bubble, peak and scheduling time. "win" = strictly lower bubble at the same or lower
peak. Then the scheduling time of each V generator at p=32, m=128.
Usage: python bench/v_frontier.py [--only 1.5B] [--first]   (--first: one m per model)
"""

from __future__ import annotations

import argparse
import platform
import time

from pipeloom import build_schedule, simulate
from pipeloom.tune.zb_profiles import AUTHORS_V, ZB_PROFILES

BUDGETS = {"p/3": 1 / 3, "p/2": 1 / 2, "5p/8": 5 / 8, "p": 1.0, "2p": 2.0}


def timed(name: str, p: int, m: int, **kwargs):
    start = time.perf_counter()
    schedule = build_schedule(name, p, m, **kwargs)
    return schedule, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one model, e.g. 1.5B")
    parser.add_argument("--first", action="store_true", help="only the first micro-batch count of each model")
    args = parser.parse_args()
    seen, tally = set(), {"win": 0, "tie": 0, "LOSS": 0}
    print(f"python {platform.python_version()} on {platform.machine()}; bubble = (largest span - useful) / span")
    print(f"{'profile':<12} {'budget':>6}  {'authors (theirs)':<26} {'pipeloom v-auto':<22} {'time s':>7}")
    for prof in ZB_PROFILES:
        if args.only not in (None, prof.model) or (args.first and prof.model in seen):
            continue
        seen.add(prof.model)
        p, m, costs = prof.num_devices, prof.num_microbatches, prof.costs
        theirs = AUTHORS_V[(prof.model, m)]
        for label, fraction in BUDGETS.items():
            budget = fraction * p
            fits = [(bubble, peak, name) for name, (bubble, peak) in theirs.items() if peak <= budget + 1e-9]
            limit = min(fits)[1] if fits else budget
            schedule, seconds = timed("v-auto", p, m, costs=costs, mem_limit=limit)
            timeline = simulate(schedule, costs)
            bubble, peak = timeline.bubble_rate, max(timeline.peak_activation_memory)
            if fits:
                their_bubble, their_peak, their_name = min(fits)
                verdict = "win" if bubble < their_bubble - 5e-5 else "tie" if bubble <= their_bubble + 5e-5 else "LOSS"
                tally[verdict] += 1
                shown = f"{their_name} {their_bubble:.4f} @ {their_peak:.2f}"
            else:
                verdict, shown = "", "- (none fits)"
            ours = f"{bubble:.4f} @ {peak:.2f}"
            print(f"{prof.model + ' m=' + str(m):<12} {label:>6}  {shown:<26} {ours:<22} {seconds:7.2f}  {verdict}")
    print(f"\nagainst the authors: {tally['win']} win(s), {tally['tie']} tie(s), {tally['LOSS']} loss(es)")
    prof = next(q for q in ZB_PROFILES if q.num_devices == 32 and q.num_microbatches == 128)
    print(f"\nscheduling time at p=32 m=128 ({prof.model} costs; goal <= 1 s each):")
    for name, kwargs in (("zb-v", {}), ("v-half", {}), ("v-min", {}), ("v-auto", {"mem_limit": 20.0})):
        schedule, seconds = timed(name, 32, 128, costs=prof.costs, **kwargs)
        timeline = simulate(schedule, prof.costs)
        print(
            f"  {name:<7} {seconds:6.2f} s   bubble {timeline.bubble_rate:.4f}  peak {max(timeline.peak_activation_memory):.2f} M_B"
        )


if __name__ == "__main__":
    main()
