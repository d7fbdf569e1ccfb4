"""The gradient sync overlapped with the pipeline against after it: dp = 2 gloo ranks of the built-in
decoder, each schedule both ways, the two ways taking turns — interleaved with two chunks on one
device per replica (2 processes: its second stage's all-reduce runs under the first stage's last
backward), zb-v on pp 2 (4 processes: two stages per device) and 1f1b on pp 2 (one stage per
device: the overlap is across devices only, as before).

Measured (per step, the median of the steps after the first, the slowest rank's): the pipeline
phase plus the sync the rank still waited for after it (`allreduce`, the part not hidden), and
the whole step. Predicted: the simulator on the costs `profile` measured for this model, its
makespan plus the sync the schedule does not hide (`sim.grad_sync.exposed_sync`, each stage's
all-reduce from its last backward on) and the share of the hidden rest the ops beside it lose
(`CostModel.sync_contention`) or, sequential, the busiest device's all-reduces after it, and,
either way, the profile's wait for the slower replica (as `tune` prices a step).
On this machine's two cores, gloo's reduction thread competes with the ranks' compute, so the
overlap hides less here than on a GPU, whose network does it beside the SMs; and four ranks on
two cores run their ops about twice as slowly as the profile (one process at a time) measured
them, which the predictions of the pp 2 rows do not know.

    python bench/grad_sync.py [--steps 6] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics

from pipeloom import build_schedule
from pipeloom.models.llama import LlamaConfig
from pipeloom.profile.profiler import profile_model
from pipeloom.runtime import TrainSpec, run_local
from pipeloom.sim import exposed_sync, simulate
from pipeloom.tune.presets import ModelSpec
from pipeloom.tune.profiled import ProfiledCostModel

MODEL = ModelSpec("bench-decoder", hidden=512, layers=8, heads=8, ffn=1024, vocab=512, seq_len=64, gated=True)
DP, M, MBS = 2, 4, 2
CASES = {"interleaved": (1, {"num_chunks": 2}), "zb-v": (2, {}), "1f1b": (2, {})}
"""schedule → (pipeline devices, its options)"""


def measured(schedule, overlap: bool, steps: int) -> tuple[float, float, float]:
    """(pipeline + unhidden sync, unhidden sync, step) in ms: medians over the steps after the
    first of the slowest rank's."""
    config = LlamaConfig(
        vocab=MODEL.vocab, hidden=MODEL.hidden, layers=MODEL.layers, heads=MODEL.heads, ffn=MODEL.ffn,
        seq_len=MODEL.seq_len, microbatch_size=MBS,
    )  # fmt: skip
    results = run_local(TrainSpec(schedule, config=config, steps=steps, dp=DP, overlap_grad_sync=overlap))
    rows = []
    for step in range(1, steps):
        phases = [result.phase_seconds[step] for result in results]
        rows.append(
            (
                max(p["pipeline"] + p["allreduce"] for p in phases),
                max(p["allreduce"] for p in phases),
                max(result.step_seconds[step] for result in results),
            )
        )
    return tuple(1e3 * statistics.median(column) for column in zip(*rows))  # type: ignore[return-value]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=2, help="runs of each way, taking turns")
    args = parser.parse_args()
    print("profiling the decoder's ops and this machine's all-reduce ...", flush=True)
    cost_model = ProfiledCostModel(profile_model(MODEL, (MBS,), (1, 2), steps=2, max_rounds=2))
    print(f"dp {DP}, {M} micro-batches of {MBS} × {MODEL.seq_len}; hidden {MODEL.hidden}, {MODEL.layers} layers")
    print(
        f"{'schedule':<17}{'sync':<12}{'predicted pipe+sync':>20}{'measured pipe+sync':>20}"
        f"{'predicted sync':>16}{'measured sync':>15}{'measured step':>15}"
    )
    for name, (P, options) in CASES.items():
        schedule = build_schedule(name, P, M, **options)
        stages = schedule.num_stages
        partition = [MODEL.layers // stages] * stages
        costs = cost_model.stage_costs(partition, MBS, P, DP)
        params = cost_model.stage_params(partition)
        timeline = simulate(schedule, costs)
        per_stage = [cost_model.allreduce_time(count, P, DP) for count in params]
        busiest = max(cost_model.allreduce_time(sum(params[s] for s in schedule.stages_on(d)), P, DP) for d in range(P))
        wait = cost_model.replica_skew(DP) * timeline.makespan  # for the slower replica, as the tuner prices it
        exposed = exposed_sync(timeline, per_stage)  # and the share of the hidden rest the ops lose
        overlapped = exposed + cost_model.sync_contention * max(0.0, busiest - exposed)
        predicted = {True: overlapped + wait, False: busiest + wait}
        runs: dict[bool, list] = {True: [], False: []}
        for _ in range(args.rounds):
            for overlap in (True, False):
                runs[overlap].append(measured(schedule, overlap, args.steps))
        for overlap in (True, False):
            piped, sync, step = (statistics.median(column) for column in zip(*runs[overlap]))
            label = "overlapped" if overlap else "after"
            print(
                f"{f'{name} pp {P}':<17}{label:<12}{timeline.makespan + predicted[overlap]:>17.1f} ms{piped:>17.1f} ms"
                f"{predicted[overlap]:>13.1f} ms{sync:>12.1f} ms{step:>12.1f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
