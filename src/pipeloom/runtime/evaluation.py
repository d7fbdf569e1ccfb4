"""Held-out loss during training: the training schedule's forward-only twin over evaluation batches.

Every `every` steps each rank runs `forward_only_of(schedule)` — its own stages' forwards in the
training order, no autograd, nothing stashed (`executor`'s forward-only path) — over the same
`batches` batches of the evaluation data (batch k drawn from (seed, k), so every evaluation sees
the same samples), each split over the replicas and micro-batches as a training batch is. The
loss is the mean over micro-batches, summed over the ranks like the training loss; perplexity is
its exponential. Forwards change no weights, so evaluating does not move the training curve.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pipeloom.models.context_parallel import ContextShard
from pipeloom.models.workload import replica_microbatches
from pipeloom.runtime.executor import DeviceExecutor

__all__ = ["Evaluation", "perplexity"]


@dataclass
class Evaluation:
    executor: DeviceExecutor
    batch: Callable
    """(rows, batch index) → inputs and targets of the held-out data."""
    every: int
    batches: int
    microbatch_size: int
    num_microbatches: int
    dp: int
    replica: int
    """The data-parallel replica whose samples this rank reads."""
    where: torch.device
    context: ContextShard | None = None
    """Under context parallelism, this rank's share of every sequence."""

    def due(self, step: int) -> bool:
        """Whether an evaluation follows step `step` (0-based): after every `every`-th."""
        return self.every > 0 and (step + 1) % self.every == 0

    def data(self, index: int) -> tuple[list, list]:
        """This replica's micro-batches of evaluation batch `index`: (inputs, targets)."""
        m, b = self.num_microbatches, self.microbatch_size
        return replica_microbatches(self.batch, index, self.dp, self.replica, m, b, self.where, self.context)


def perplexity(loss: float) -> float:
    """exp(loss), infinite past what a float holds."""
    return math.exp(loss) if loss < 700 else math.inf
