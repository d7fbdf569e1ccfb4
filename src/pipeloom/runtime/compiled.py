"""Compiled stages (`--compile`): each stage, a partial checkpoint's halves and the loss under
`torch.compile`, for every schedule.

A stage compiles whole — its embedding, layers, final norm and head — since most of what
compiling gains lies outside the decoder blocks (the head and the loss over the vocabulary);
compiling each block alone leaves that eager. The loss compiles as its own graph: the logits
reach it in the compute type and inductor fuses the upcast, the log-softmax and the pick of the
target, so no fp32 copy of the logits is kept for the backward. A schedule that splits the
backward keeps its W: the split linears are custom ops the compiler keeps (`split_linear`).
A stage's slices (`forward_slice`) compile too; a stage compiles once per variant the executor
runs (with and without autograd, deferring its W or not), so dynamo's recompile limit is raised
by what these stages may need.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["compile_stages"]

_VARIANTS = 8
"""Graphs a stage may need: autograd on or off × W deferred or not × whole or sliced."""


def compile_stages(stages: dict[int, nn.Module], halves: dict[int, tuple[Callable, Callable]], loss: Callable):
    """Compile `stages` in place (the modules stay the objects the buckets, hooks and optimizer
    hold), their partial-checkpoint `halves` in place, and return the compiled `loss`."""
    config = torch._dynamo.config
    config.recompile_limit += _VARIANTS * len(stages)
    config.accumulated_recompile_limit += _VARIANTS * len(stages)
    for stage, module in stages.items():
        module.compile()
        forward_slice = getattr(module, "forward_slice", None)
        if forward_slice is not None:
            object.__setattr__(module, "forward_slice", torch.compile(forward_slice))  # an instance attribute
        if stage in halves:
            head, tail = halves[stage]
            halves[stage] = (torch.compile(head), torch.compile(tail))
    return torch.compile(loss)
