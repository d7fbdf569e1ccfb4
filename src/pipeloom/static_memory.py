"""Static memory — weights, gradients, optimizer state — under each measure the runtime implements.

The planner and the runtime (`pipeloom.runtime.zero`, `pipeloom.runtime.offload`) share these
figures, so a plan's static memory is what the ranks hold. Per weight, with c the bytes of the
compute type (2 for bf16/fp16, 4 for fp32) and dp the data-parallel size:

| measure  | weights | gradients  | optimizer (fp32 master + AdamW moments) | host |
|----------|---------|------------|-----------------------------------------|------|
| ZeRO-0   | 4       | 4          | 8 (the weights are the master copy)     | 0    |
| ZeRO-1   | c       | 4          | 12/dp                                   | 0    |
| ZeRO-2   | c       | c + 4/dp   | 12/dp                                   | 0    |
| offload  | c       | 4          | 0                                       | 16   |

ZeRO-0 keeps fp32 weights and computes under autocast; the other measures keep the weights in
the compute type and an fp32 master copy: sharded over the data-parallel replicas (ZeRO-1/2,
each shard the same size, ceil(params/dp)), or on the host with the gradients' copy (offload,
TPipe's T-Offload for any set of stages). ZeRO-1 reduce-scatters the fp32 gradients in place,
ZeRO-2 accumulates them in the compute type and reduce-scatters them into an fp32 shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ZERO_LEVELS", "StaticBytes", "collective_bytes", "compute_bytes", "offload_saving", "static_bytes"]

ZERO_LEVELS = (0, 1, 2)


@dataclass(frozen=True)
class StaticBytes:
    weights: float
    gradients: float
    optimizer: float
    host: float = 0.0

    @property
    def device(self) -> float:
        return self.weights + self.gradients + self.optimizer

    def to_dict(self) -> dict:
        return {
            "weights": self.weights,
            "gradients": self.gradients,
            "optimizer": self.optimizer,
            "device": self.device,
            "host": self.host,
        }


def compute_bytes(dtype: str) -> int:
    """Bytes per element of a compute type name (bf16, fp16, fp32)."""
    return 4 if dtype == "fp32" else 2


def static_bytes(
    params: float, dp: int = 1, zero: int = 0, offloaded: bool = False, compute: int = 2, padded: bool = False
) -> StaticBytes:
    """Bytes of `params` weights under a measure (see the table); `padded`: a whole count of
    weights cut into equal shards of ceil(params/dp), the runtime's exact figure."""
    if zero not in ZERO_LEVELS:
        raise ValueError(f"ZeRO level must be one of {ZERO_LEVELS}, got {zero!r}")
    if offloaded:
        return StaticBytes(compute * params, 4 * params, 0.0, 16 * params)
    if zero == 0:
        return StaticBytes(4 * params, 4 * params, 8 * params)
    shard = math.ceil(params / dp) if padded else params / dp
    buffer = shard * dp  # the weight and gradient buffers, padded to equal shards
    gradients = 4 * buffer if zero == 1 else compute * buffer + 4 * shard
    return StaticBytes(compute * buffer, gradients, 12 * shard)


def offload_saving(params: float, dp: int = 1, zero: int = 0, compute: int = 2) -> float:
    """Device bytes that offloading a stage's optimizer frees, from its ZeRO level's figure."""
    kept = static_bytes(params, dp, zero, compute=compute).device
    return max(0.0, kept - static_bytes(params, offloaded=True, compute=compute).device)


def collective_bytes(params: float, dp: int, zero: int, compute: int = 2) -> float:
    """Bytes one rank moves per step to sum gradients over dp replicas (ring algorithms): an
    all-reduce of fp32 gradients (ZeRO-0) or a reduce-scatter (ZeRO-1/2), plus the all-gather of
    the new weights in the compute type (ZeRO-1/2)."""
    if dp == 1:
        return 0.0
    share = (dp - 1) / dp
    reduce = share * 4 * params * (2 if zero == 0 else 1)
    gather = share * compute * params if zero else 0.0
    return reduce + gather
