"""Passes: pure functions that rewrite a schedule into another valid one (docs/design.md §4)."""

from pipeloom.passes.checkpoint import (
    apply_checkpoint,
    overlap_recompute,
    prepose_forward,
    relax_checkpoint,
    remove_redundancy,
)
from pipeloom.passes.mario import mario
from pipeloom.passes.offload import OffloadPlan, OffloadTimeline, simulate_offload, t_offload
from pipeloom.passes.split_backward import W_PLACEMENTS, fold_lone_w, fold_w_at_once, split_backward
from pipeloom.passes.trecomp import chunk_delay_rounds, t_recomp
from pipeloom.passes.weight_parts import weight_parts

__all__ = [
    "W_PLACEMENTS",
    "OffloadPlan",
    "OffloadTimeline",
    "apply_checkpoint",
    "chunk_delay_rounds",
    "fold_lone_w",
    "fold_w_at_once",
    "mario",
    "overlap_recompute",
    "prepose_forward",
    "relax_checkpoint",
    "remove_redundancy",
    "simulate_offload",
    "split_backward",
    "t_offload",
    "t_recomp",
    "weight_parts",
]
