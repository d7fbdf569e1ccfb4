"""How the executor calls a stage: one forward under the precision policy, or a stage cut in two.

A stage is any callable from a tensor (or tuple) to a tensor (or tuple); with slices it also has
`forward_slice`, and for a partial checkpoint `split_at(k)` (the built-in decoder, Hugging Face
stages and block stages have both where they make sense).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.runtime.boundary import as_tuple
from pipeloom.runtime.precision import Precision

__all__ = ["run_stage", "split_stage", "earlier_keys_values"]

Tensors = tuple[torch.Tensor, ...]


def split_stage(module: nn.Module, layers: int) -> tuple[Callable, Callable]:
    """A stage's (head, tail) for a checkpoint of its first `layers` layers."""
    split = getattr(module, "split_at", None)
    if split is None:
        raise ConfigError(
            f"--recompute-layers: a {type(module).__name__} stage has no split_at(k) to cut it into a recomputed "
            "head and a kept tail (the built-in decoder, Hugging Face models and block models have one)"
        )
    return split(layers)


def run_stage(
    module: Any, x: Tensors, past: list | None, precision: Precision, device: torch.device, hand_on: bool
) -> tuple[Tensors, list]:
    """A stage's forward as the executor runs it: (outputs — cast to the compute type when they are
    handed on to the next stage; this slice's keys and values per layer, [] unsliced)."""
    with precision.autocast(device):
        if past is not None:
            out, new_kv = module.forward_slice(*x, past)
        else:
            out, new_kv = module(*x), []
    out = as_tuple(out)
    return (precision.cast(out) if hand_on else out), new_kv


def earlier_keys_values(kv: dict, op, num_slices: int) -> list | None:
    """Per layer, the keys and values (leaves) a slice's stage computed for the earlier slices of
    its micro-batch, concatenated along the sequence; None without slices. `kv` maps a slice's
    (stage, micro-batch, slice) to (its keys/values per layer, their leaves)."""
    if num_slices == 1:
        return None
    earlier = [kv[(op.stage, op.microbatch, s)][1] for s in range(op.slice)]
    if not earlier:
        return []
    return [
        (
            torch.cat([layers[i][0] for layers in earlier], dim=-2),
            torch.cat([layers[i][1] for layers in earlier], dim=-2),
        )
        for i in range(len(earlier[0]))
    ]
