"""Chrome / Perfetto trace JSON of a simulated timeline: open it at ui.perfetto.dev.

One track per device with ops named by their text form, a memory counter per device, and one
track per T-Offload lane (copy engine, host) that does any work.
Simulated time has no unit of its own; `time_unit_us` says how many microseconds one unit is
(default 1000: costs read as milliseconds).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from os import PathLike
from typing import Any

from pipeloom.sim.simulate import Timeline

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(timeline: Timeline, time_unit_us: float = 1000.0, lanes: Sequence = ()) -> dict[str, Any]:
    schedule = timeline.schedule
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 0, "name": "process_name", "args": {"name": f"pipeloom {schedule.name}"}},
    ]
    for device in range(schedule.num_devices):
        events.append({"ph": "M", "pid": 0, "tid": device, "name": "thread_name", "args": {"name": f"device {device}"}})
        events.append({"ph": "M", "pid": 0, "tid": device, "name": "thread_sort_index", "args": {"sort_index": device}})
    for timing in timeline.timings():
        op = timing.op
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": timing.device,
                "name": op.text,
                "cat": op.kind.value,
                "ts": timing.start * time_unit_us,
                "dur": (timing.end - timing.start) * time_unit_us,
                "args": {"stage": op.stage, "microbatch": op.microbatch, "slice": op.slice, "step": timing.step},
            }
        )
    events += _lane_events(lanes, schedule.num_devices, time_unit_us)
    for device in range(schedule.num_devices):
        for time, level in timeline.memory_curve(device):
            events.append(
                {
                    "ph": "C",
                    "pid": 0,
                    "name": f"memory device {device}",
                    "ts": time * time_unit_us,
                    "args": {"memory": level},
                }
            )
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"schedule": schedule.name, "makespan": timeline.makespan, "bubble_rate": timeline.bubble_rate},
    }


def write_chrome_trace(
    timeline: Timeline, path: str | PathLike[str], time_unit_us: float = 1000.0, lanes: Sequence = ()
) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(chrome_trace(timeline, time_unit_us, lanes), handle)


def _lane_events(lanes: Sequence, num_devices: int, time_unit_us: float) -> list[dict[str, Any]]:
    """T-Offload's LaneOps on tracks after the devices, one per (device, lane) that works."""
    tracks: dict[tuple[int, str], int] = {}
    events: list[dict[str, Any]] = []
    for op in sorted(lanes, key=lambda op: (op.device, op.kind.lane, op.start)):
        if op.end <= op.start:
            continue
        key = (op.device, op.kind.lane)
        if key not in tracks:
            tid = tracks[key] = num_devices + len(tracks)
            events.append(
                {
                    "ph": "M",
                    "pid": 0,
                    "tid": tid,
                    "name": "thread_name",
                    "args": {"name": f"device {op.device} {op.kind.lane}"},
                }
            )
            events.append({"ph": "M", "pid": 0, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        events.append(
            {
                "ph": "X",
                "pid": 0,
                "tid": tracks[key],
                "name": op.text,
                "cat": op.kind.value,
                "ts": op.start * time_unit_us,
                "dur": (op.end - op.start) * time_unit_us,
                "args": {"stage": op.stage, "deadline": op.deadline * time_unit_us},
            }
        )
    return events
