"""A rank's static memory as measured beside the plan's: what `train` reports and the tests check.

Measured: the bytes of the tensors the rank's optimizers hold (weights, gradients, AdamW state;
host copies under T-Offload). Planned: `pipeloom.static_memory`'s figures for as many weights,
at the run's data-parallel size and ZeRO level.
"""

from __future__ import annotations

from pipeloom.runtime.precision import Precision
from pipeloom.runtime.rank_setup import leaves_of
from pipeloom.runtime.spec import ParallelPart
from pipeloom.runtime.zero import ShardedAdamW
from pipeloom.static_memory import compute_bytes, static_bytes

__all__ = ["rank_static_bytes"]


def rank_static_bytes(parallel: ParallelPart, stepper, host, parameters, precision: Precision) -> tuple[dict, dict]:
    """(measured, planned) weight, gradient, optimizer and host bytes of this rank: the tensors it
    holds, beside `pipeloom.static_memory`'s figures for as many weights."""
    compute = compute_bytes(precision.name)
    measured = {
        "weights": stepper.weight_bytes,
        "gradients": stepper.gradient_bytes,
        "optimizer": stepper.optimizer_bytes,
        "host": 0,
    }
    # ZeRO shards each optimizer over its own replicas: the experts' over those holding the same experts
    sharded = [part for part in leaves_of(stepper) if isinstance(part, ShardedAdamW)]
    parts = [(part.parameters, part.size) for part in sharded] or [(parameters, parallel.replicas)]
    planned: dict = {}
    for held, replicas in parts:
        figures = static_bytes(sum(t.numel() for t in held), replicas, parallel.zero, compute=compute, padded=True)
        for key, value in figures.to_dict().items():
            planned[key] = planned.get(key, 0) + value
    planned.pop("device")
    if host is not None:
        on_host = [t for params in host.device_params.values() for t in params]
        offloaded = static_bytes(sum(t.numel() for t in on_host), offloaded=True, compute=compute)
        measured["weights"] += sum(t.numel() * t.element_size() for t in on_host)
        measured["gradients"] += host.store.bytes
        measured["host"] = host.host_bytes
        planned["weights"] += offloaded.weights
        planned["gradients"] += offloaded.gradients
        planned["host"] = offloaded.host
    return measured, planned
