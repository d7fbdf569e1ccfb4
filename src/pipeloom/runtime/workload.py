"""What the runtime trains: stage modules, the data of a step, the loss — for any model.

`llama_workload` is the default (the small LLaMA-style decoder on synthetic tokens);
`blocks_workload` cuts any list of nn.Module blocks into stages. Every rank calls `build` and
must get identical stages (seed inside it), so that all copies start from the same weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.models.llama import LlamaConfig, build_stages, synthetic_batch

__all__ = ["Workload", "llama_workload", "blocks_workload", "token_loss"]


@dataclass(frozen=True)
class Workload:
    build: Callable[[int], list[nn.Module]]
    """Number of stages → the stage modules, identical on every call."""
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
    """(rows, step) → inputs and targets of a step, identical on every rank."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """Last stage's output and targets of one micro-batch → its mean loss."""
    activation_shape: tuple[int, ...]
    """What crosses between stages for one micro-batch."""
    microbatch_size: int


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def llama_workload(config: LlamaConfig, seed: int, layer_counts: Sequence[int] | None = None) -> Workload:
    return Workload(
        build=lambda num_stages: build_stages(config, num_stages, seed, layer_counts),
        batch=lambda rows, step: synthetic_batch(config, rows, seed, step),
        loss=token_loss,
        activation_shape=(config.microbatch_size, config.seq_len, config.hidden),
        microbatch_size=config.microbatch_size,
    )


def blocks_workload(
    blocks: Callable[[], Sequence[nn.Module]],
    batch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int],
    microbatch_size: int,
    counts: Sequence[int] | None = None,
) -> Workload:
    """Any model given as consecutive blocks: stage s runs blocks counts[0..s) onwards (balanced
    by default, the earlier stages taking the remainder)."""

    def build(num_stages: int) -> list[nn.Module]:
        made = list(blocks())
        sizes = list(counts) if counts is not None else None
        if sizes is None:
            if len(made) < num_stages:
                raise ConfigError(f"{len(made)} blocks cannot be cut into {num_stages} stages")
            base, extra = divmod(len(made), num_stages)
            sizes = [base + (1 if s < extra else 0) for s in range(num_stages)]
        if len(sizes) != num_stages or sum(sizes) != len(made) or min(sizes) < 0:
            raise ConfigError(f"block counts {sizes} must be {num_stages} numbers summing to {len(made)}")
        stages, first = [], 0
        for size in sizes:
            stages.append(nn.Sequential(*made[first : first + size]))
            first += size
        return stages

    return Workload(build, batch, loss, tuple(activation_shape), microbatch_size)
