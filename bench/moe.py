"""DualPipeV's overlapped pairs for real: a mixture of experts with expert parallelism, where the
all-to-alls are a large share of a forward, trained three ways on pp = 2 × dp = 2 gloo ranks with
--ep 2 (4 forked processes):

* dualpipev — its F&B pairs run by turns, each op computing while the other's dispatch or combine
  is in flight (`runtime.pair_baton`);
* the same op order unpaired — every op alone, each all-to-all waited for;
* zb-v — the zero-bubble V schedule on the same stages, no pairs.

Predicted: the simulator on the costs `profile` measures for this model (its ops and its
all-to-alls per layer, ep 2), the pipeline's makespan. Measured: the runtime's pipeline phase
(median over the steps after the first, rank 0) and, from every rank, the all-to-alls' time in
flight, the part in flight while a paired op could run, and the part hidden under it.
Usage: python bench/moe.py [--steps N]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import tempfile
from pathlib import Path

from pipeloom import build_schedule
from pipeloom.profile.profiler import profile_model
from pipeloom.runtime import TrainSpec, hf_workload, run_local
from pipeloom.sim.simulate import simulate
from pipeloom.tune.presets import model_from_config
from pipeloom.tune.profiled import ProfiledCostModel

CONFIG = {  # eight experts, two per token, wide enough that routing tokens costs as much as attention
    "model_type": "mixtral",
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 1024,
}
SEQ, MBS, M, P, DP, EP = 256, 2, 4, 2, 2, 2


def unpaired(schedule):
    """The same op order with every pair split into its two ops."""
    return schedule.with_devices(
        [[dataclasses.replace(op, overlap_next=False) for op in ops] for ops in schedule.devices],
        name=f"{schedule.name} unpaired",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        (Path(directory) / "config.json").write_text(json.dumps(CONFIG))
        model = dataclasses.replace(model_from_config(CONFIG, name="mixtral-bench"), seq_len=SEQ)

        def workload_for(layers: int, mbs: int):
            return hf_workload(directory, 0, mbs, SEQ, layers=layers)

        print("profiling the model's ops and its all-to-alls (ep 2) ...", flush=True)
        profile = profile_model(model, (MBS,), (1, 2), steps=2, workload_for=workload_for, max_rounds=2)
        cost_model = ProfiledCostModel(profile)
        cost_model.model = dataclasses.replace(cost_model.model, expert_parallel=EP)
        stages = 2 * P
        costs = cost_model.stage_costs([CONFIG["num_hidden_layers"] // stages] * stages, MBS, P, DP)
        print(
            f"per stage: F {costs.F[0]:.1f} ms (a2a_F {costs.a2a_F[0]:.1f} ms of it), "
            f"B {costs.B[0]:.1f} ms (a2a_B {costs.a2a_B[0]:.1f} ms), W {costs.W[0]:.1f} ms"
        )
        paired = build_schedule("dualpipev", P, M, costs=costs)
        pairs = sum(op.overlap_next for ops in paired.devices for op in ops)
        rows = [("dualpipev (pairs)", paired), ("dualpipev unpaired", unpaired(paired))]
        rows.append(("zb-v", build_schedule("zb-v", P, M)))
        work = hf_workload(directory, 1, MBS, SEQ)
        print(f"\n{pairs} overlapped pairs per step; pp {P} × dp {DP}, ep {EP}, {M} micro-batches of {MBS} × {SEQ}")
        header = (
            f"{'schedule':<20} {'predicted ms':>12} {'measured ms':>11} {'a2a ms':>7} {'overlapped':>10} {'hidden':>7}"
        )
        print(header + f" {'hidden/overlapped':>17}")
        for label, schedule in rows:
            predicted = simulate(schedule, costs).makespan
            results = run_local(TrainSpec(schedule, workload=work, steps=args.steps, dp=DP, ep=EP))
            pipeline = statistics.median(1e3 * phases["pipeline"] for phases in results[0].phase_seconds[1:])
            records = [record for result in results for record in result.records[1:]]
            flight = statistics.median(r.a2a_ms for r in records)
            overlapped = statistics.median(r.a2a_overlapped_ms for r in records)
            hidden = statistics.median(r.a2a_ms - r.a2a_exposed_ms for r in records)
            share = f"{hidden / overlapped:.0%}" if overlapped else "-"
            print(
                f"{label:<20} {predicted:>12.1f} {pipeline:>11.1f} {flight:>7.1f} {overlapped:>10.1f} "
                f"{hidden:>7.1f} {share:>17}",
                flush=True,
            )


if __name__ == "__main__":
    main()
