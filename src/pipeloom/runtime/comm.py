"""Point-to-point messages of a schedule: who sends what to whom, in which order.

The messages are the schedule's data dependencies that cross devices and stages, read off the
dependency graph (`ir.graph`) that validation and the simulator use — so the runtime moves
exactly the tensors whose edges the simulator charges `comm` for. An F(s-1) → F(s) edge carries
an activation; a B(s+1) → B(s) edge (or → the R inside B(s)'s backward, which takes it for its
B) carries an input gradient. Placement is data: one plan serves 1F1B, interleaved, V-shapes
(whose turn stays on one device and is handed over in memory) and Chimera (whose two replicas of
a stage sit on different devices). For each ordered pair of devices the sender sends in its own
op order and the receiver posts all its receives ahead in that order; an op then waits only for
its own inputs. So any schedule whose dependency graph is acyclic runs to completion
(docs/design.md §5), and no shapes or counts are ever exchanged at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.ir.graph import build_graph
from pipeloom.ir.ops import OpKind
from pipeloom.ir.schedule import Schedule

__all__ = ["Message", "MessagePlan", "plan_messages"]

_F, _B, _BW = OpKind.F, OpKind.B, OpKind.BW


@dataclass(frozen=True, slots=True)
class Message:
    """An activation (`grad=False`: output of F(stage-1) for F(stage)) or an input gradient
    (`grad=True`: from B(stage+1) for B(stage)) of one micro-batch slice."""

    grad: bool
    stage: int
    """The stage that consumes it."""
    microbatch: int
    slice: int
    src: int
    dst: int

    def tag(self, num_stages: int, num_microbatches: int, num_slices: int) -> int:
        index = (self.stage * num_microbatches + self.microbatch) * num_slices + self.slice
        return 2 * index + int(self.grad)


@dataclass(frozen=True)
class MessagePlan:
    schedule: Schedule
    forward_device: dict[tuple[int, int, int], int]
    backward_device: dict[tuple[int, int, int], int]
    sends: list[list[Message]]
    """Per device, in its op order."""
    receives: list[list[Message]]
    """Per device, grouped by sender, each sender's messages in the sender's op order."""

    def tag(self, message: Message) -> int:
        s = self.schedule
        return message.tag(s.num_stages, s.num_microbatches, s.num_slices)


def plan_messages(schedule: Schedule) -> MessagePlan:
    graph = build_graph(schedule)
    ops, device_of = graph.ops, graph.device_of
    consumers: list[list[int]] = [[] for _ in ops]
    for g, needs in enumerate(graph.deps):
        for h in needs:
            consumers[h].append(g)
    forward_device: dict[tuple[int, int, int], int] = {}
    backward_device: dict[tuple[int, int, int], int] = {}
    for g, op in enumerate(ops):
        if op.kind is _F:
            forward_device[op.key] = device_of[g]
        elif op.kind in (_B, _BW):
            backward_device[op.key] = device_of[g]
    sends: list[list[Message]] = [[] for _ in range(schedule.num_devices)]
    for h, producer in enumerate(ops):  # flat order: each device's ops in its own order
        sent: set[int] = set()
        for g in consumers[h]:
            consumer = ops[g]
            if consumer.stage == producer.stage or device_of[g] == device_of[h] or device_of[g] in sent:
                continue  # a slice's own keys and values, a hand-over in memory, or already on its way
            grad = producer.kind is not _F
            sends[device_of[h]].append(Message(grad, consumer.stage, *consumer.key[1:], device_of[h], device_of[g]))
            sent.add(device_of[g])
    receives: list[list[Message]] = [[] for _ in range(schedule.num_devices)]
    for device_sends in sends:
        for message in device_sends:
            receives[message.dst].append(message)
    return MessagePlan(schedule, forward_device, backward_device, sends, receives)
