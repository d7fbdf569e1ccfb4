"""What Megatron's tensor-parallel layout (`pipeloom.runtime.tensor_parallel`) does to a stage,
as the profiled cost model prices it: which collectives its ops run, the bytes a rank sends for
them, and a rank's share of the activations.

Pure functions of (tp, sequence parallel): the layout is fixed when a cost model is made.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "activation_share",
    "layer_collectives",
    "replicated_params",
    "ring_bytes",
    "stage_collectives",
]


def replicated_params(hidden: int, layers: int) -> int:
    """The weights sequence parallelism leaves whole on every tp rank of a device holding `layers`
    layers: each layer's two norms and the final one (whose gradients each rank takes from its
    shard of the sequence, summed over the tp ranks after the pipeline)."""
    return (2 * layers + 1) * hidden


def layer_collectives(tp: int, sequence_parallel: bool) -> dict[str, list[str]]:
    """A layer's: its attention and its MLP each enter the region and leave it."""
    if tp == 1:
        return {"F": [], "B": []}
    if sequence_parallel:
        return {"F": ["all_gather", "reduce_scatter"] * 2, "B": ["reduce_scatter", "all_gather"] * 2}
    return {"F": ["allreduce"] * 2, "B": ["allreduce"] * 2}


def stage_collectives(tp: int, sequence_parallel: bool, stage: int, stages: int, layers: int) -> dict[str, list[str]]:
    """The tensor-parallel collectives of a stage's F and B (R repeats F's; W has none), each on
    one activation of the micro-batch."""
    if tp == 1:
        return {"F": [], "B": []}
    sp = sequence_parallel
    enter, leave = (["all_gather"], ["reduce_scatter"]) if sp else ([], ["allreduce"])
    back_enter = ["reduce_scatter"] if sp else ["allreduce"]
    per_layer = layer_collectives(tp, sp)
    forward, backward = per_layer["F"] * layers, per_layer["B"] * layers
    if stage == 0:
        forward += leave  # the vocabulary-parallel embedding's partial rows
    if stage == stages - 1:
        forward += enter  # into the vocabulary-parallel head
        backward += back_enter
    if not sp:  # the sequence shards a stage receives, and its shard of the output gradient
        forward += ["all_gather"] if stage > 0 else []
        backward += ["all_gather"] if stage < stages - 1 else []
    return {"F": forward, "B": backward}


def ring_bytes(names: Sequence[str], nbytes: float, tp: int) -> float:
    """Bytes one rank sends for `names` on `nbytes` by the ring: 2(tp−1)/tp of an all-reduce's,
    (tp−1)/tp of an all-gather's or reduce-scatter's."""
    return sum(nbytes * (tp - 1) / tp * (2 if name == "allreduce" else 1) for name in names)


def activation_share(tp: int, sequence_parallel: bool) -> float:
    """A rank's share of a layer's activations (Korthikanti et al.: 34 bytes·sbh of which 24
    split without sequence parallelism, all of them with it; the attention scores left out)."""
    if tp == 1:
        return 1.0
    return 1 / tp if sequence_parallel else (10 + 24 / tp) / 34
