"""DualPipe and DualPipeV against 1F1B, ZB-H1 and ZB-V, with and without communication to hide.

An MoE-like profile: per device share of the model, F = B = W = 1 ms, p2p 0.05 ms, and the
expert all-to-all inside each forward and backward a2a = 30 % of F (a2a_F = a2a_B = 0.3 ms), then
the same with a2a = 0. Each schedule runs at the same p and m. A lone forward waits for its own
all-to-all (F + a2a_F); an overlapped F&B pair hides each side's under the other's compute
(`StageCosts.pair_time`). "step ms" is pipeloom's schedule built for these costs (DualPipe splits
the pairs that hide nothing); "as paper" keeps every pair of the reference, "unpaired" splits them
all: the pair overlap is worth "pair gain" = unpaired − as paper, and only where a2a > 0.
Usage: python bench/dualpipe.py [--p 4,8] [--m-per-device 4] [--plot PATH]
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from pipeloom import Costs, build_schedule, simulate
from pipeloom.schedules import get_generator

SCHEMES = ("1f1b", "zb-h1", "zb-v", "dualpipe", "dualpipev")
PARAMETER_COPIES = {"dualpipe": 2}


def unpaired(schedule):
    return schedule.with_devices(
        [[replace(op, overlap_next=False) for op in ops] for ops in schedule.devices], name=schedule.name + "-unpaired"
    )


def build(name: str, p: int, m: int, costs: Costs | None):
    takes_costs = "costs" in get_generator(name).options
    return build_schedule(name, p, m, **({"costs": costs} if takes_costs and costs else {}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", default="4,8", help="pipeline sizes (even, for DualPipe)")
    parser.add_argument("--m-per-device", type=int, default=4, help="micro-batches per device (m = this × p)")
    parser.add_argument("--plot", metavar="PATH", help="draw the p=first, a2a=30%% dualpipev timeline")
    args = parser.parse_args()
    for p in (int(x) for x in args.p.split(",")):
        m = args.m_per_device * p
        print(f"\np = {p} devices, m = {m} micro-batches; F = B = W = 1 ms, p2p 0.05 ms per message")
        print(
            f"{'schedule':<10} {'a2a':>5} {'step ms':>8} {'as paper':>9} {'unpaired':>9} {'pair gain':>9} {'bubble':>7} "
            f"{'vs 1f1b':>8} {'act. M_B':>8} {'params':>6}"
        )
        for a2a in (0.3, 0.0):
            costs = Costs(F=1, B=1, W=1, comm=0.05, a2a_F=a2a, a2a_B=a2a, M_B=1)
            base = simulate(build("1f1b", p, m, costs), costs).makespan
            for name in SCHEMES:
                schedule = build(name, p, m, costs)
                timeline = simulate(schedule, costs)
                if name.startswith("dualpipe"):
                    reference = build(name, p, m, None)
                    as_paper = simulate(reference, costs).makespan
                    split = simulate(unpaired(reference), costs).makespan
                    columns = f"{as_paper:>9.2f} {split:>9.2f} {(split - as_paper) / split:>9.1%}"
                else:
                    columns = f"{'—':>9} {'—':>9} {'—':>9}"
                print(
                    f"{name:<10} {a2a:>4.0%} {timeline.makespan:>8.2f} {columns} "
                    f"{timeline.bubble_rate:>7.1%} {(base - timeline.makespan) / base:>+8.1%} "
                    f"{max(timeline.peak_activation_memory):>8.2f} {PARAMETER_COPIES.get(name, 1):>5}×"
                )
                if args.plot and name == "dualpipev" and a2a and p == int(args.p.split(",")[0]):
                    from pipeloom.viz.plot import plot_timeline

                    plot_timeline(timeline, args.plot)
    print("\nact. M_B: peak activation memory, in M_B (one device's share of the model, one micro-batch)")
    print("params: copies of the model's weights the pipeline holds (DualPipe keeps two)")


if __name__ == "__main__":
    main()
