"""What a training run leaves behind: one Chrome/Perfetto trace of every rank, a JSON summary."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from os import PathLike

from pipeloom.runtime.training import RankResult

__all__ = ["summary", "write_summary", "write_trace"]


def summary(results: Sequence[RankResult], **context) -> dict:
    """Losses per step, median step time (first step left out when there are more), peak stash
    bytes per rank, recomputes per rank over the run."""
    first = results[0]
    times = first.step_seconds[1:] or first.step_seconds
    return {
        **context,
        "losses": first.losses,
        "step_seconds": first.step_seconds,
        "median_step_seconds": statistics.median(times) if times else None,
        "peak_stash_bytes": [max((r.peak_stash_bytes for r in result.records), default=0) for result in results],
        "recomputes": [sum(r.recomputes for r in result.records) for result in results],
    }


def write_summary(results: Sequence[RankResult], path: str | PathLike[str], **context) -> None:
    with open(path, "w") as handle:
        json.dump(summary(results, **context), handle, indent=2)


def write_trace(results: Sequence[RankResult], path: str | PathLike[str]) -> None:
    """One track per rank (ops as complete events), a stash-bytes counter per rank; steps follow
    each other on the time axis at their measured durations."""
    events: list[dict] = []
    for result in results:
        events.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": result.rank, "args": {"name": f"rank {result.rank}"}}
        )
        offset = 0.0
        for step, (record, seconds) in enumerate(zip(result.records, result.step_seconds)):
            for text, start, end in record.ops:
                events.append(
                    {
                        "name": text,
                        "ph": "X",
                        "pid": 0,
                        "tid": result.rank,
                        "ts": (offset + start) * 1e6,
                        "dur": max(end - start, 0.0) * 1e6,
                        "args": {"step": step},
                    }
                )
            for moment, held in record.stash:
                events.append(
                    {
                        "name": f"stash bytes rank {result.rank}",
                        "ph": "C",
                        "pid": 0,
                        "ts": (offset + moment) * 1e6,
                        "args": {"bytes": held},
                    }
                )
            offset += seconds
    with open(path, "w") as handle:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, handle)
