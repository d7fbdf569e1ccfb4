"""Schedule validity (docs/design.md §1): complete, co-located, and free of deadlock."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeloom.ir.graph import DependencyGraph, build_graph
from pipeloom.ir.walk import run

if TYPE_CHECKING:  # only named in annotations: the IR's modules build on Schedule, not back
    from pipeloom.ir.schedule import Schedule

__all__ = ["validate"]


def validate(schedule: Schedule) -> DependencyGraph:
    """Raise ScheduleError naming the offending ops, or return the schedule's dependency graph.

    Completeness and co-location are checked while the graph is built; a deadlock is a cycle in
    data dependencies ∪ device order, found by walking the graph with zero durations.
    """
    graph = build_graph(schedule)
    run(graph, [0.0] * graph.num_ops)
    return graph
