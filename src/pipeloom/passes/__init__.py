"""Passes: pure functions that rewrite a schedule into another valid one (DESIGN §4)."""

from pipeloom.passes.checkpoint import (
    apply_checkpoint,
    overlap_recompute,
    prepose_forward,
    relax_checkpoint,
    remove_redundancy,
)
from pipeloom.passes.mario import mario
from pipeloom.passes.split_backward import W_PLACEMENTS, split_backward

__all__ = [
    "W_PLACEMENTS",
    "apply_checkpoint",
    "mario",
    "overlap_recompute",
    "prepose_forward",
    "relax_checkpoint",
    "remove_redundancy",
    "split_backward",
]
