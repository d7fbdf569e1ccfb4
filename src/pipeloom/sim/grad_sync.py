"""The data-parallel gradient sync of a step, overlapped with its pipeline as the runtime runs it.

Each stage's gradients are summed over its copies (the dp replicas, Chimera's twin) by one
all-reduce that starts as soon as the stage's last backward op (B, W or BW) on the device ends
(`runtime.gradients.GradientBuckets.watch`) — under the device's later ops and the other
devices' work. A device's all-reduces share its link, so they run one after another in the order
their stages became ready. The step ends when every device has run its last op and its last
all-reduce has finished; what the sync adds to the step is how far that lies past the pipeline's
makespan. With every stage ready only at the end this is the sequential sync (the sum of a
device's all-reduces, the busiest device's); with a V-shape or interleaving a device's early
stages sum under its later ones.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.ir.ops import OpKind
from pipeloom.sim.simulate import Timeline

__all__ = ["exposed_sync", "sync_lanes"]

_BACKWARD = (OpKind.B, OpKind.W, OpKind.BW)


def sync_lanes(timeline: Timeline, stage_sync: Sequence[float]) -> list[tuple[float, float]]:
    """Per device: (its last op's end, its last all-reduce's end), `stage_sync[s]` being the time
    of stage s's all-reduce (in the timeline's unit)."""
    lanes = []
    for device in range(timeline.num_devices):
        ready: dict[int, float] = {}
        end = 0.0
        for timing in timeline.timings(device):
            end = max(end, timing.end)
            if timing.op.kind in _BACKWARD:
                ready[timing.op.stage] = max(ready.get(timing.op.stage, 0.0), timing.end)
        lane = 0.0
        for stage in sorted(ready, key=lambda s: (ready[s], s)):
            lane = max(lane, ready[stage]) + stage_sync[stage]
        lanes.append((end, lane))
    return lanes


def exposed_sync(timeline: Timeline, stage_sync: Sequence[float]) -> float:
    """What the overlapped gradient sync adds to the step: the time past the makespan until every
    device's last all-reduce has ended (0 when the pipeline hides it all)."""
    finish = max((max(end, lane) for end, lane in sync_lanes(timeline, stage_sync)), default=0.0)
    return max(0.0, finish - timeline.makespan)
