"""Schedule validity (DESIGN §1): complete, co-located, and free of deadlock."""

from __future__ import annotations

from pipeloom.ir.graph import DependencyGraph, build_graph
from pipeloom.ir.schedule import Schedule

__all__ = ["validate"]


def validate(schedule: Schedule) -> DependencyGraph:
    """Raise ScheduleError naming the offending ops, or return the schedule's dependency graph.

    Completeness and co-location are checked while the graph is built; a deadlock is a cycle in
    data dependencies ∪ device order, found by walking the graph with zero durations.
    """
    from pipeloom.sim.engine import run  # the walk is the simulator's kernel; imported late to keep layers one-way

    graph = build_graph(schedule)
    run(graph, [0.0] * graph.num_ops)
    return graph
