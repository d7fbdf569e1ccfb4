"""Merge several fixed op orders per device into one, by greedy list scheduling.

Schemes that superpose pipelines (Chimera's two directions) keep each pipeline's own order and
interleave them on each device. Under nominal op durations, whenever a device is free it runs
whichever of its queue heads can start earliest; when several can start at the same time it
switches away from the queue it ran last (alternation is what lets two pipelines fill each
other's bubbles), then takes the lower queue. The merged order is a topological order of the
dependency graph by construction, so it never deadlocks when each queue is valid on its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence

from pipeloom.ir.graph import build_graph
from pipeloom.ir.ops import Op
from pipeloom.ir.schedule import Schedule

__all__ = ["merge_queues"]


def merge_queues(
    name: str,
    queues: Sequence[Sequence[Sequence[Op]]],
    *,
    num_stages: int,
    num_microbatches: int,
    duration: Callable[[Op], float],
) -> Schedule:
    """`queues[d]` holds device d's queues, each in its fixed order; returns the merged schedule."""
    concatenated = Schedule.build(
        name,
        [[op for queue in device for op in queue] for device in queues],
        num_stages=num_stages,
        num_microbatches=num_microbatches,
    )
    graph = build_graph(concatenated)
    num_ops = graph.num_ops
    users: list[list[int]] = [[] for _ in range(num_ops)]
    for g, deps in enumerate(graph.deps):
        for dep in deps:
            users[dep].append(g)
    # Queue q of device d covers flat ops bounds[d][q] .. bounds[d][q + 1] - 1; head[d][q] is next.
    bounds: list[list[int]] = []
    queue_of = [0] * num_ops
    for d, device in enumerate(queues):
        edges = [graph.offsets[d]]
        for q, queue in enumerate(device):
            edges.append(edges[-1] + len(queue))
            queue_of[edges[q] : edges[q + 1]] = [q] * len(queue)
        bounds.append(edges)
    head = [edges[:-1] for edges in bounds]
    end = [-1.0] * num_ops
    free = [0.0] * len(queues)
    last_queue = [-1] * len(queues)

    def priority(g: int) -> tuple[float, bool, int, int] | None:
        """(start, same queue as last time, queue, op) if g heads its queue with inputs ready."""
        d, q = graph.device_of[g], queue_of[g]
        if head[d][q] != g or end[g] >= 0:
            return None
        start = free[d]
        for dep in graph.deps[g]:
            if end[dep] < 0:
                return None
            start = max(start, end[dep])
        return (start, q == last_queue[d], q, g)

    heap: list[tuple[float, bool, int, int]] = []

    def offer(g: int) -> None:
        entry = priority(g)
        if entry is not None:
            heapq.heappush(heap, entry)

    for edges in bounds:
        for q in range(len(edges) - 1):
            if edges[q] < edges[q + 1]:
                offer(edges[q])
    merged: list[list[Op]] = [[] for _ in queues]
    while heap:
        entry = heapq.heappop(heap)
        current = priority(entry[3])
        if current is None:
            continue  # stale: already run
        if current != entry:
            heapq.heappush(heap, current)  # the device got busy or switched queues since the offer
            continue
        start, _, q, g = entry
        d = graph.device_of[g]
        end[g] = free[d] = start + duration(graph.ops[g])
        last_queue[d] = q
        merged[d].append(graph.ops[g])
        head[d][q] = g + 1
        for other in range(len(bounds[d]) - 1):
            if head[d][other] < bounds[d][other + 1]:
                offer(head[d][other])
        for user in users[g]:
            offer(user)
    return concatenated.with_devices(merged)
