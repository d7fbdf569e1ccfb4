"""What sharing a mixture's experts out (--ep) does to a stage beyond its all-to-alls, as the
profiled cost model prices it from the profile's expert-parallel probes (`profile.ep_probes`,
the profile's `a2a`: one stage of L layers trained by ep = 2 replicas): the stash and compute
that layout adds per layer, and the replicas' wait for each other at the gradient sync.

Each takes the probe's measurement less what the tp = 1 fits (`value`: the cost model's fitted
`key`, `field`, micro-batch size → value) and the links price for the same stage, so whatever
the fits already hold is not counted twice.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from pipeloom.profile_format import ExpertExchange
from pipeloom.tune.profile_fits import at_size

__all__ = ["compute_per_layer", "replicas_wait", "stash_per_layer"]

Fitted = Callable[[str, str, float], float]


def stash_per_layer(exchange: Mapping[int, ExpertExchange], value: Fitted, micro_batch: float) -> float:
    """What sharing the experts out changes in a layer's stash (bytes): the stash measured on the
    probe's stage, less what the fits give for it, over its L layers (here: 2.5 MiB less on 4
    Mixtral layers); 0 without that measurement."""
    shifts = {
        size: (v.M_B - value("M_B", "per_layer", size) * v.layers - value("M_B", "single", size)) / v.layers
        for size, v in exchange.items()
        if v.M_B is not None and v.layers
    }
    return at_size(shifts, micro_batch, signed=True) if shifts else 0.0


def compute_per_layer(exchange: Mapping[int, ExpertExchange], value: Fitted, micro_batch: float) -> dict[str, float]:
    """What sharing the experts out adds to an F's and a backward's compute per layer (ms) beyond
    their all-to-alls: the ops timed on the probe's stage, less those all-to-alls and what the
    fits give for it, over L — the dispatch's bookkeeping (counting, ordering and splitting the
    tokens by expert) and each rank's experts over both replicas' tokens. Here 0.6–6 ms an op of
    4 Mixtral layers, which priced an expert-parallel step 12–19 % short without it. Empty
    without that measurement (older profiles)."""
    fitted = {"F": ("F",), "BW": ("B", "W")}
    shifts: dict[str, dict[int, float]] = {"F": {}, "BW": {}}
    for size, v in exchange.items():
        if v.F_op is None or v.BW_op is None or not v.layers:
            continue
        layers = v.layers
        for kind, keys in fitted.items():
            stage = sum(value(k, "per_layer", size) * layers + value(k, "single", size) for k in keys)
            exchanges, whole = (v.F, v.F_op) if kind == "F" else (v.B, v.BW_op)
            shifts[kind][size] = (whole - exchanges * layers - stage) / layers
    if not shifts["F"]:
        return {}
    return {kind: at_size(values, micro_batch, signed=True) for kind, values in shifts.items()}


def replicas_wait(cost_model) -> float:
    """The expert-parallel replicas' wait at the gradient sync, as a share of the pipeline: rank
    0's step beyond its pipeline on the probes (`tail_ms` over `pipeline_ms`, at the largest size
    measured), less what `cost_model` prices there — the dense gradients' all-reduce over the
    probes' ep replicas (a routed expert's gradients stay on the one that holds it), the AdamW step
    over what a rank holds and the step overhead. Without it, an expert-parallel plan's gradient
    sync ran 3.3–4.1 ms against 1.8–1.9 ms predicted in bench/fidelity.py. 0 for profiles that
    measured none."""
    exchange: Mapping[int, ExpertExchange] = cost_model.exchange
    sizes = [size for size, v in exchange.items() if v.tail_ms is not None and v.pipeline_ms and v.layers]
    if not sizes:
        return 0.0
    probe = exchange[max(sizes)]
    ep = cost_model.expert_ep
    params, layers = cost_model.params, probe.layers
    assert probe.tail_ms is not None and probe.pipeline_ms and layers  # as `sizes` chose it
    dense = layers * (params.layer - params.experts) + params.first + params.last
    held = dense + layers * params.experts / ep
    expected = (
        cost_model.allreduce_time(dense, 1, ep) + cost_model.optimizer_time(held, ep) + cost_model.step_overhead_time()
    )
    return max(0.0, probe.tail_ms - expected) / probe.pipeline_ms
