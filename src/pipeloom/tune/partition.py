"""Layers per stage: contiguous, at least one each, minimising the largest stage.

Stage i costs n_i·c_i + e_i for n_i layers: c_i per layer (a layer's time to balance time; its
memory times the stage's in-flight micro-batches to balance memory) and e_i extra (the embedding
on the first stage, the head and loss on the last). The least achievable bottleneck T is found by
binary search over the values n·c_i + e_i: stage i can take at most ⌊(T − e_i)/c_i⌋ layers, and
T is feasible when those capacities reach the layer count. Surplus capacity is then taken back
from the stages that cost most. The result is Megatron's uneven layout (fewer layers on the end
stages) when the ends carry extra work.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import lru_cache

from pipeloom.errors import InfeasibleError

__all__ = ["partition_layers", "partition_variants", "layout_string"]


def partition_layers(num_layers: int, per_layer: Sequence[float], extra: Sequence[float]) -> list[int]:
    """Layer counts for len(per_layer) stages.

    >>> partition_layers(8, [1, 1, 1, 1], [1, 0, 0, 1])  # embedding and head cost a layer each
    [1, 3, 3, 1]
    >>> partition_layers(10, [1, 1, 1], [0, 0, 0])
    [4, 3, 3]
    """
    return list(_balanced(num_layers, tuple(per_layer), tuple(extra)))


@lru_cache(maxsize=1024)
def _balanced(num_layers: int, per_layer: tuple[float, ...], extra: tuple[float, ...]) -> tuple[int, ...]:
    """Cached: the tuner asks for the same stage costs once per scheme and ZeRO level."""
    stages = len(per_layer)
    if num_layers < stages:
        raise InfeasibleError(f"{num_layers} layers cannot fill {stages} stages of at least one layer each")

    def capacity(limit: float) -> list[int]:
        return [max(0, math.floor((limit - e) / c + 1e-9)) if c > 0 else num_layers for c, e in zip(per_layer, extra)]

    candidates = sorted({n * c + e for c, e in zip(per_layer, extra) for n in range(1, num_layers + 1)})
    low, high = 0, len(candidates) - 1
    while low < high:
        middle = (low + high) // 2
        caps = capacity(candidates[middle])
        if min(caps) >= 1 and sum(caps) >= num_layers:
            high = middle
        else:
            low = middle + 1
    counts = [min(cap, num_layers) for cap in capacity(candidates[low])]
    surplus = sum(counts) - num_layers
    while surplus > 0:  # give back layers where a stage costs most, keeping one each
        i = max(
            (i for i in range(stages) if counts[i] > 1),
            key=lambda i: (counts[i] * per_layer[i] + extra[i], extra[i], i),
        )
        counts[i] -= 1
        surplus -= 1
    return tuple(counts)


def partition_variants(counts: Sequence[int]) -> list[list[int]]:
    """Other layouts worth simulating beside the balanced one (`counts`): the smallest stage's
    time is not the step's. A first stage's forward is on every micro-batch's path and the last
    carries the head, so the balanced layout's extra layer on the first stage or its lighter last
    stage can cost a pipeline more than a stage a layer heavier elsewhere (GPT3-13B on 16
    stages of 8 layers: the even split is 4 % faster under ZB-H1, moving the first stage's extra
    layer on 5 % under zb-auto). So: the even split, and one layer moved off each end stage.

    >>> partition_variants([9, 8, 8, 7])
    [[8, 8, 8, 8], [8, 9, 8, 7], [9, 8, 9, 6]]
    """
    stages, layers = len(counts), sum(counts)
    if stages < 2:
        return []
    even, extra = divmod(layers, stages)
    middle = (stages - extra) // 2  # the heavier stages in the middle, away from both ends
    variants = [[even + (middle <= i < middle + extra) for i in range(stages)]]
    for end, neighbour in ((0, 1), (stages - 1, stages - 2)):
        if counts[end] > 1:
            moved = list(counts)
            moved[end] -= 1
            moved[neighbour] += 1
            variants.append(moved)
    unique = []
    for variant in variants:
        if variant != list(counts) and variant not in unique and min(variant) >= 1:
            unique.append(variant)
    return unique


def layout_string(counts: Sequence[int]) -> str:
    """Megatron-style layout: E = embedding, t = transformer layer, L = loss, | between stages.

    >>> layout_string([1, 3, 3, 1])
    'Et|ttt|ttt|tL'
    """
    parts = ["t" * n if n <= 8 else f"t*{n}" for n in counts]
    return "E" + "|".join(parts) + "L"
