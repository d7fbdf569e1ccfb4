"""The largest model that fits: plain 1F1B against pipeloom's best plan, by bisection on depth.

The model family is GPT-3 13B's layer (hidden 3000, 40 heads, ffn 12000, sequence 1024) stacked
to any depth. For each cluster the script bisects the layer count at which a plan still fits:

* plain 1F1B — the 1f1b schedule, no memory-saving pass, no static-memory measure (ZeRO-0:
  fp32 weights and AdamW on every replica);
* pipeloom — every scheme, Mario / T-Recomp / T-Offload where activations are short, and ZeRO-1,
  ZeRO-2 or every stage's optimizer on the host where static memory is short — within the host
  memory per GPU (`--host-memory`, default the preset's: a DGX A100's 1 TiB over 8 GPUs for
  a100-40g), which holds the offloaded stages' fp32 master weights, gradients and moments.

Then it prints the best plan and its throughput at a few sizes up to pipeloom's largest. Mario
reports a 5.3× larger model than 1F1B on 16 A100s; the goal is at least that.
Usage: python bench/capacity.py [--cluster a100-40g:16] [--global-batch 64] [--max-mbs 1] [--host-memory 128]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time

from pipeloom.errors import InfeasibleError
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import TuneResult, tune
from pipeloom.tune.space import power_of_two_sizes

CLUSTERS = ("a100-40g:16", "a100-80g:8", "h100:64")
PLAIN = {"schemes": ("1f1b",), "memory_passes": False, "static_measures": False}
GOAL = 5.3


def fits(
    layers: int, hardware: str, devices: int, batch: int, mbs: list[int], host: float, **space
) -> TuneResult | None:
    model = dataclasses.replace(load_model("gpt3-13b"), layers=layers, name=f"gpt-13b-shape x{layers}")
    cost_model = AnalyticCostModel(model, load_hardware(hardware))
    memory = cost_model.hardware.memory
    try:
        result = tune(cost_model, devices, memory, batch, keep=1, micro_batches=mbs, host_memory=host, **space)
    except InfeasibleError:
        return None
    result.cost_model = cost_model
    return result


def largest(probe, start: int = 8) -> int:
    """The largest layer count for which `probe` fits (0 if none): doubling, then bisection."""
    if probe(start) is None:
        low, high = 0, start
    else:
        low, high = start, 2 * start
        while probe(high) is not None:
            low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if probe(middle) is not None else (low, middle)
    return low


def describe(result: TuneResult) -> str:
    best = result.best
    static = max(best.static_memory) / 2**30
    host = max(best.host_memory, default=0.0)  # the offloaded stages' fp32 master weights, gradients, moments
    assert host <= result.host_memory, f"{best.candidate.label} holds {host / 2**30:.1f} GiB on a host"
    return (
        f"{best.candidate.label}: {result.throughput(best):.3g} samples/s, step {best.step_time:,.0f} ms, "
        f"device peak {max(best.peak_memory) / 2**30:.1f} GiB (static {static:.1f}), host {host / 2**30:.0f} GiB per GPU"
    )


def run(cluster: str, batch: int, mbs: list[int], host_gib: float | None) -> float:
    hardware, devices = cluster.split(":")
    devices = int(devices)
    host = load_hardware(hardware).host_memory if host_gib is None else host_gib * 2**30
    began = time.perf_counter()
    plain = largest(lambda n: fits(n, hardware, devices, batch, mbs, host, **PLAIN))
    best = largest(lambda n: fits(n, hardware, devices, batch, mbs, host), start=max(8, plain))
    seconds = time.perf_counter() - began
    params = dataclasses.replace(load_model("gpt3-13b"), layers=1).layer_params
    ratio = best / plain if plain else float("inf")
    limit = f"{host / 2**30:.0f} GiB" if math.isfinite(host) else "unlimited"
    print(
        f"\n{devices} × {hardware}, global batch {batch}, host memory {limit} per GPU (bisection took {seconds:.0f} s)"
    )
    print(f"  plain 1F1B fits up to {plain} layers ({plain * params / 1e9:.1f}B parameters in the layers)")
    print(f"  pipeloom fits up to   {best} layers ({best * params / 1e9:.1f}B): {ratio:.2f}× (goal ≥ {GOAL}×)")
    sizes = sorted({plain, *(plain * 2**k for k in range(1, 8) if plain * 2**k < best), best} - {0})
    for layers in sizes:
        result = fits(layers, hardware, devices, batch, mbs, host)
        plain_result = fits(layers, hardware, devices, batch, mbs, host, **PLAIN)
        line = describe(result) if result else "no plan fits"
        extra = f"; plain 1F1B {plain_result.throughput(plain_result.best):.3g} samples/s" if plain_result else ""
        print(f"  {layers:>5} layers: {line}{extra}")
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", action="append", help=f"hardware:devices (default: {', '.join(CLUSTERS)})")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--max-mbs", type=int, default=1, help="largest micro-batch size tried (default 1)")
    parser.add_argument(
        "--host-memory", type=float, metavar="GIB", help="host memory per GPU, GiB (default: the preset's)"
    )
    parser.add_argument("--unlimited-host", action="store_true", help="do not check host memory (as before)")
    args = parser.parse_args()
    host = math.inf if args.unlimited_host else args.host_memory
    for cluster in args.cluster or CLUSTERS:
        run(cluster, args.global_batch, power_of_two_sizes(args.max_mbs), host)


if __name__ == "__main__":
    main()
