"""Passes: pure functions that rewrite a schedule into another valid one (DESIGN §4)."""

from pipeloom.passes.split_backward import W_PLACEMENTS, split_backward

__all__ = ["W_PLACEMENTS", "split_backward"]
