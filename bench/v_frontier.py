"""The V family against its authors' schedules on Zero Bubble Table 6's profiles.

For each profile and each memory budget (p/3, p/2, 5p/8, p and 2p, in M_B) this prints the
authors' best named schedule within the budget (ZB-V at p·M_B and 2p·M_B, V-Half, V-Min; their
bubble and peak from `zb_profiles.AUTHORS_V`, obtained by running their code), then pipeloom's
`v-auto` given the authors' peak as its limit (or the budget, where no schedule of theirs fits),
with its bubble, peak and scheduling time. "win" = strictly lower bubble at the same or lower
peak. Then the scheduling time of each V generator at p=32, m=128, and zb-auto's at p=32, m=96.

Uneven costs (`--uneven N`, 0 to skip): N random inputs outside Table 6, half with equal stages,
half with per-stage times varying ±20–30 % (p 4–16, m from p to 8p, comm up to F, M_W up to
M_B), against the authors' methods as pipeloom re-expresses them (`v_greedy` planned on the
median device's times at their budgets p·M_B and 2p·M_B, as their runtime plans ZB-V;
`zb_heuristic` on the median and on the exact times): `v-auto` at the authors' ZB-V peak, and
`zb-auto` at a limit drawn from (p, 2p]·M_B.
Usage: python bench/v_frontier.py [--only 1.5B] [--first] [--uneven N] [--seed S]
"""

from __future__ import annotations

import argparse
import platform
import random
import time

from pipeloom import Costs, build_schedule, simulate
from pipeloom.schedules import clear_caches
from pipeloom.schedules.v_greedy import median_plan, v_greedy
from pipeloom.schedules.zb_heuristic import median_table, zb_heuristic
from pipeloom.tune.zb_profiles import AUTHORS_V, ZB_PROFILES

BUDGETS = {"p/3": 1 / 3, "p/2": 1 / 2, "5p/8": 5 / 8, "p": 1.0, "2p": 2.0}


def timed(name: str, p: int, m: int, **kwargs):
    """A fresh build: nothing an earlier call cached (schedules, greedy runs, orders) helps it."""
    clear_caches()
    start = time.perf_counter()
    schedule = build_schedule(name, p, m, **kwargs)
    return schedule, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="one model, e.g. 1.5B")
    parser.add_argument("--first", action="store_true", help="only the first micro-batch count of each model")
    parser.add_argument("--uneven", type=int, default=40, help="random inputs in the uneven-cost section (0: skip)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the uneven-cost inputs")
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
    for label, v_costs in (("", prof.costs), (", F ±20 % per stage", _uneven(prof.costs, 64))):
        print(f"\nscheduling time at p=32 m=128 ({prof.model} costs{label}; goal <= 1 s each):")
        for name, kwargs in (("zb-v", {}), ("v-half", {}), ("v-min", {}), ("v-auto", {"mem_limit": 20.0})):
            schedule, seconds = timed(name, 32, 128, costs=v_costs, **kwargs)
            timeline = simulate(schedule, v_costs)
            print(
                f"  {name:<7} {seconds:6.2f} s   bubble {timeline.bubble_rate:.4f}  "
                f"peak {max(timeline.peak_activation_memory):.2f} M_B"
            )
    for label, costs in (("uniform", prof.costs), ("uneven", _uneven(prof.costs, 32))):
        for factor in (1, 1.5, 2):
            _, seconds = timed("zb-auto", 32, 96, costs=costs, mem_limit=factor * 32)
            print(f"  zb-auto p=32 m=96 {label} costs, limit {factor:g}p·M_B: {seconds:.3f} s (goal <= 0.15 s)")
    if args.uneven:
        uneven_section(args.uneven, args.seed)


def _uneven(costs: Costs, stages: int) -> Costs:
    rng = random.Random(1)
    return Costs(
        **{**costs.to_dict(), "F": tuple(costs.stage_value("F", 0) * rng.uniform(0.8, 1.2) for _ in range(stages))}
    )


def random_input(rng: random.Random, stages: int, uniform: bool, per_stage_mb: float) -> Costs:
    spread = 0.0 if uniform else rng.uniform(0.2, 0.3)

    def times(mean: float) -> tuple[float, ...]:
        return tuple(mean * (1 + rng.uniform(-spread, spread)) for _ in range(stages))

    f = rng.uniform(0.5, 3.0)
    return Costs(
        F=times(f),
        B=times(rng.uniform(0.5, 3.0)),
        W=times(rng.uniform(0.3, 2.5)),
        comm=rng.uniform(0, f),
        M_B=(per_stage_mb,) * stages,
        M_W=(rng.uniform(0, per_stage_mb),) * stages,
    )


def uneven_section(count: int, seed: int) -> None:
    rng = random.Random(seed)
    tally = {"V": {"win": 0, "tie": 0, "LOSS": 0}, "ZB": {"win": 0, "tie": 0, "LOSS": 0}}
    worst = {"V": 0.0, "ZB": 0.0}
    slowest = {"V": 0.0, "ZB": 0.0}

    def verdict(family: str, ours: float, theirs: float) -> None:
        change = (ours - theirs) / theirs
        tally[family]["win" if change < -1e-9 else "tie" if change <= 1e-9 else "LOSS"] += 1
        worst[family] = max(worst[family], change)

    print(f"\nuneven costs: {count} random inputs (seed {seed}), half with equal stages")
    for index in range(count):
        uniform = index % 2 == 0
        p = rng.randint(4, 16)
        m = rng.randint(p, 8 * p)
        costs = random_input(rng, 2 * p, uniform, 0.5)
        table = costs.resolve(p, 2 * p)
        for factor in (1, 2):
            try:
                theirs = simulate(v_greedy("authors", p, m, median_plan(table, p), [factor * p * 1.0] * p), costs)
            except Exception:
                continue
            peak = max(theirs.peak_activation_memory)
            ours, seconds = timed("v-auto", p, m, costs=costs, mem_limit=peak)
            slowest["V"] = max(slowest["V"], seconds)
            verdict("V", simulate(ours, costs).cost, theirs.cost)
        costs = random_input(rng, p, uniform, 1.0)
        table = costs.resolve(p, p)
        limit = p * rng.uniform(1.0, 2.0)
        ours, seconds = timed("zb-auto", p, m, costs=costs, mem_limit=limit)
        slowest["ZB"] = max(slowest["ZB"], seconds)
        ours_cost = simulate(ours, costs).cost
        for plan in (median_table(table), table):
            run = zb_heuristic(m, plan, table, [limit] * p)
            if run is not None:
                verdict("ZB", ours_cost, run.cost)
    for family, what in (
        ("V", "v-auto vs the authors' ZB-V (p·M_B, 2p·M_B)"),
        ("ZB", "zb-auto vs the authors' ZB heuristic"),
    ):
        t = tally[family]
        print(
            f"  {what}: {t['win']} win(s), {t['tie']} tie(s), {t['LOSS']} loss(es); worst {100 * worst[family]:+.2f} %; "
            f"slowest {slowest[family]:.2f} s"
        )


if __name__ == "__main__":
    main()
