"""Point-to-point messages of a schedule: who sends what to whom, in which order.

Placement is data: the device of every op is read off the schedule, so one plan serves 1F1B,
interleaved, V-shapes (whose turn stays on one device and is handed over in memory) and Chimera
(whose two replicas of a stage sit on different devices). For each ordered pair of devices the
sender sends in its own op order and the receiver derives that same order from the schedule and
posts all its receives ahead; an op then waits only for its own inputs. So any schedule whose
dependency graph is acyclic runs to completion (docs/design.md §5), and no shapes or counts are ever
exchanged at run time.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    forward_device: dict[tuple[int, int, int], int] = {}
    backward_device: dict[tuple[int, int, int], int] = {}
    for device, _, op in schedule.ops():
        if op.kind is _F:
            forward_device[op.key] = device
        elif op.kind in (_B, _BW):
            backward_device[op.key] = device
    last = schedule.num_stages - 1
    sends: list[list[Message]] = [[] for _ in range(schedule.num_devices)]
    for device, _, op in schedule.ops():
        stage, mb, slice_ = op.key
        if op.kind is _F and stage < last:
            consumer = forward_device[(stage + 1, mb, slice_)]
            if consumer != device:
                sends[device].append(Message(False, stage + 1, mb, slice_, device, consumer))
        elif op.kind in (_B, _BW) and stage > 0:
            consumer = backward_device[(stage - 1, mb, slice_)]
            if consumer != device:
                sends[device].append(Message(True, stage - 1, mb, slice_, device, consumer))
    receives: list[list[Message]] = [[] for _ in range(schedule.num_devices)]
    for device_sends in sends:
        for message in device_sends:
            receives[message.dst].append(message)
    return MessagePlan(schedule, forward_device, backward_device, sends, receives)
