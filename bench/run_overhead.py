"""What a run costs beyond its steps: a small forked run, a small in-process run, and indexing a
schedule's dependency graph (what every simulation of a new schedule starts with). Prints the
median of each; asserts nothing. These are the costs the runtime's test tiers pay hundreds of
times a suite, and a user's `pipeloom train --nproc` and `tune` once per run or candidate.

Usage: python bench/run_overhead.py [--repeat 9]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

from pipeloom.ir.graph import build_graph
from pipeloom.models.llama import LlamaConfig
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.local import run_local
from pipeloom.runtime.training import TrainSpec
from pipeloom.schedules import build_schedule


def tiny(schedule) -> LlamaConfig:
    """The tests' decoder: at least a layer a stage."""
    return LlamaConfig(layers=max(4, schedule.num_stages), hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def median_s(repeat: int, run) -> float:
    run()  # the first run imports and warms what later ones reuse
    times = []
    for _ in range(repeat):
        began = time.perf_counter()
        run()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=9, help="runs per case; the median is reported")
    repeat = parser.parse_args().repeat
    one_f_one_b = build_schedule("1f1b", 2, 4)
    forked = TrainSpec(one_f_one_b, config=tiny(one_f_one_b), steps=1, dp=2)
    built = [
        build_schedule(name, p, 2 * p, **options)
        for name, options in (("1f1b", {}), ("zb-v", {}), ("interleaved", {"num_chunks": 2}), ("zb-h1", {}))
        for p in (2, 4)
    ]
    in_process = [TrainSpec(schedule, config=tiny(schedule), steps=2) for schedule in built]
    shapes = [("zb-v", 8, 32, {}), ("1f1b", 16, 64, {}), ("interleaved", 8, 32, {"num_chunks": 2})]
    schedules = [build_schedule(name, p, m, **options) for name, p, m, options in shapes]
    ops = sum(len(device) for schedule in schedules for device in schedule.devices)

    def index_all() -> None:
        for schedule in schedules:
            object.__setattr__(schedule, "_graph", None)  # the graph is kept on a schedule: index anew
            build_graph(schedule)

    print(f"python {platform.python_version()} on {platform.machine()}, median of {repeat}")
    print("case                                                        time")
    ms = median_s(repeat, lambda: run_local(forked)) * 1e3
    print(f"forked run, tiny decoder, pp2 x dp2 (4 ranks), 1 step    {ms:8.0f} ms")
    ms = median_s(repeat, lambda: [run_in_process(spec) for spec in in_process]) * 1e3 / len(in_process)
    print(f"in-process run, tiny decoder, 4 schedules x p 2|4, 2 steps {ms:6.0f} ms a run")
    ms = median_s(repeat, index_all) * 1e3
    print(f"dependency graph of 3 schedules, {ops:,} ops               {ms:8.2f} ms ({ops / ms * 1e3:,.0f} ops/s)")


if __name__ == "__main__":
    main()
