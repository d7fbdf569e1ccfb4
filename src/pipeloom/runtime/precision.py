"""Mixed precision: compute and stage-to-stage messages in bf16/fp16, fp32 master weights.

The parameters, their gradients and AdamW's state stay fp32 (the master copy); each stage's
forward runs under `torch.autocast`, so its matrix products run in the compute type, and the
tensors it hands to the next stage are cast to that type — half the p2p bytes of fp32. Gradients
come back through autocast's casts as fp32 and are reduced in fp32. fp16's narrow range needs a
dynamic loss scale (`LossScaler`): the loss is multiplied by it, the reduced gradients divided,
and a step whose gradients overflowed is skipped — by the same global NaN/Inf decision that
clipping and post-validation make — and halves the scale.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pipeloom.errors import ConfigError

__all__ = ["DTYPES", "Precision", "LossScaler"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Precision:
    name: str = "fp32"
    """fp32, bf16 or fp16: the type of compute and of the activations between stages."""

    def __post_init__(self) -> None:
        if self.name not in DTYPES:
            raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {self.name!r}")

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.name]

    @property
    def mixed(self) -> bool:
        return self.name != "fp32"

    def autocast(self, device: torch.device):
        """The context a stage's forward (and recompute) runs in."""
        if not self.mixed:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.dtype)

    def cast(self, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Floating tensors crossing a stage boundary, in the compute type (differentiably)."""
        if not self.mixed:
            return tensors
        return tuple(t.to(self.dtype) if t.is_floating_point() else t for t in tensors)


class LossScaler:
    """fp16's dynamic loss scale (as torch.amp.GradScaler): halve after an overflowing step,
    double after `growth_interval` clean ones. Every rank sees the same global decisions, so
    every rank holds the same scale."""

    def __init__(self, initial: float = 2.0**16, growth_interval: int = 2000) -> None:
        self.scale = float(initial)
        self.growth_interval = growth_interval
        self._clean = 0
        self.overflows = 0

    def update(self, stepped: bool) -> None:
        if not stepped:
            self.scale /= 2.0
            self._clean = 0
            self.overflows += 1
            return
        self._clean += 1
        if self._clean >= self.growth_interval:
            self.scale *= 2.0
            self._clean = 0
