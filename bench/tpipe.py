"""TPipe: T-Pipe, T-Recomp and T-Offload against 1F1B, recompute and interleaving.

Costs are LLaMA-like, per device share of the model and micro-batch: T_F = 1, T_B = 2, comm = 0.01,
M_B = 1, and a checkpointed chunk keeps its input, 2 % of its activations (a few layers' input).
1F1B + 50 % recompute checkpoints every stage, keeping half its activations (plus the input) and
recomputing the other half (R = F/2) inside the backward. T-Recomp recomputes each device's
shallowest chunk block-wise (R = F of the chunk); with v = 4 or 6 chunks it recomputes the
shallower half, the same recompute work as 1F1B + 50 %. For p ∈ {4, 8, 16}, m ∈ {2p, 4p} it prints the
largest peak activation memory as a share of 1F1B's (m_a) and the makespan relative to
1F1B + 50 % recompute. Goal: T-Pipe + T-Recomp at ≤ ½ the activation memory of 1F1B + 50 %
recompute within 3 % of its makespan.

Then T-Offload on T-Pipe + T-Recomp (deep chunk offloaded, 8-bit reloads): model state 16 bytes
per parameter, of which 14 (fp32 master weights, Adam moments, bf16 gradients) leave the device;
the lanes' work is swept as ρ = (gradient copy + host optimizer step of a chunk) / (that chunk's
backward of one micro-batch), copy : host step = 1 : 3. It prints the static memory saved, the
overlap fraction (TPipe Fig. 15's quantity: the lanes' work done while the device idles), the
share done before its deadline, and the delay of the step.
Usage: python bench/tpipe.py [--p 4 8 16]
"""

from __future__ import annotations

import argparse
import platform

from pipeloom import Costs, build_schedule, simulate
from pipeloom.passes import apply_checkpoint, simulate_offload, t_offload, t_recomp

BASE = {"F": 1.0, "B": 2.0, "comm": 0.01, "M_B": 1.0}
INPUT = 0.02  # of a checkpointed chunk's activations


def schemes(p: int, m: int):
    """(name, schedule, costs) of every scheme compared; T-Recomp rows recompute half the layers,
    as 1F1B + 50 % recompute does, with v = 2, 4 or 6 chunks per device."""
    half = Costs(**BASE, M_ckpt=INPUT / 2, recompute_fraction=0.5)
    chunk = Costs(**BASE, M_ckpt=INPUT)
    tpipe = build_schedule("tpipe", p, m)
    interleaved = build_schedule("interleaved", p, m, num_chunks=2)
    return [
        ("1F1B", build_schedule("1f1b", p, m), Costs(**BASE)),
        ("1F1B + 50% recompute", apply_checkpoint(build_schedule("1f1b", p, m)), half),
        ("interleaved", interleaved, Costs(**BASE)),
        ("T-Pipe", tpipe, Costs(**BASE)),
        ("T-Pipe + T-Recomp", t_recomp(tpipe), chunk),
        ("T-Pipe v=4 + T-Recomp 0,1", t_recomp(build_schedule("tpipe", p, m, num_chunks=4), (0, 1)), chunk),
        ("T-Pipe v=6 + T-Recomp 0-2", t_recomp(build_schedule("tpipe", p, m, num_chunks=6), (0, 1, 2)), chunk),
        ("interleaved + T-Recomp", t_recomp(interleaved), chunk),
    ]


def memory_and_time(ps: list[int]) -> None:
    print("peak: largest peak activation memory / 1F1B's (m_a); time: makespan / 1F1B + 50% recompute's")
    print("vs 1F1B+50%: peak activation memory and makespan over 1F1B + 50% recompute's (goal ≤ 0.5 and ≤ 1.03)")
    for p in ps:
        for m in (2 * p, 4 * p):
            results = {name: simulate(schedule, costs) for name, schedule, costs in schemes(p, m)}
            m_a = max(results["1F1B"].peak_activation_memory)
            half = results["1F1B + 50% recompute"]
            print(f"\np={p} m={m}")
            print(f"  {'scheme':<26} {'peak':>6} {'time':>6}   {'vs 1F1B+50%':>12}")
            for name, timeline in results.items():
                peak = max(timeline.peak_activation_memory)
                line = f"  {name:<26} {peak / m_a:>6.3f} {timeline.makespan / half.makespan:>6.3f}"
                if "T-Recomp" in name and name.startswith("T-Pipe"):
                    memory = peak / max(half.peak_activation_memory)
                    time = timeline.makespan / half.makespan
                    verdict = "goal met" if memory <= 0.5 and time <= 1.03 else "goal missed"
                    line += f"   {memory:.3f} {time:.3f}  {verdict}"
                print(line)


def offload(ps: list[int]) -> None:
    print("\nT-Offload on T-Pipe + T-Recomp (deep chunk, 8-bit reloads)")
    print(f"{'p':>3} {'m':>4} {'rho':>4} {'static saved':>12} {'overlap':>8} {'on time':>8} {'delay':>7}")
    # rho: a chunk's copy + host step over its backward of one micro-batch
    for p in ps:
        for m in (2 * p, 4 * p):
            schedule = t_recomp(build_schedule("tpipe", p, m))
            for rho in (2.0, 4.0, 8.0, 16.0):
                # A chunk is half a device share: its backward takes B/2 = 1; its lane work rho.
                chain = rho * 2  # per device share, as Costs scalars are
                costs = Costs(
                    **BASE,
                    M_ckpt=INPUT,
                    M_static=16.0,
                    M_offload=14.0,
                    offload_bytes=chain / 4,
                    reload_bytes=chain / 4,
                    host_step_flops=chain * 3 / 4,
                    host_bandwidth=1.0,
                    host_flops=1.0,
                )
                result = simulate_offload(t_offload(schedule, reload_bits=8), costs)
                saved = result.static_memory_saved[0] / result.baseline.static_memory[0]
                print(
                    f"{p:>3} {m:>4} {rho:>4g} {saved:>12.1%} {result.overlap_fraction:>8.1%} {result.on_time_fraction:>8.1%} "
                    f"{result.delay / result.baseline.makespan:>7.2%}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args()
    print(f"python {platform.python_version()} on {platform.machine()}")
    memory_and_time(args.p)
    offload(args.p)


if __name__ == "__main__":
    main()
