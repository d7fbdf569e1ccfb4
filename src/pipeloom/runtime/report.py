"""What a training run leaves behind: one Chrome/Perfetto trace of every rank, a JSON summary."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from os import PathLike

from pipeloom.runtime.training import RankResult

__all__ = ["summary", "write_summary", "write_trace", "run_context", "run_report", "data_line"]


def data_line(spec) -> str:
    """What the run trains on, in one line: printed before the first step and in the report, so
    a run on synthetic tokens never passes for one on the user's data."""
    from pipeloom.provenance import describe

    return f"data: {describe(spec.resolved_workload().data)}"


def run_context(spec) -> dict:
    """What a run was, for its summary and its report's header."""
    return {
        "schedule": spec.schedule.name,
        "p": spec.schedule.num_devices,
        "dp": spec.dp,
        "tp": spec.tp,
        "cp": spec.cp,
        "sequence_parallel": spec.sequence_parallel,
        "ep": spec.ep,
        "model": spec.resolved_workload().name,
        "data": spec.resolved_workload().data,
        "dtype": spec.dtype,
        "device": spec.torch_device_type,
        "zero": spec.zero,
        "config": spec.run_config,
    }


def run_report(results: Sequence[RankResult], spec) -> str:
    """The header line and the per-rank table that a finished run prints (CLI, torchrun, run_local)."""
    from pipeloom.runtime.metrics import final_table

    facts = summary(results, spec.peak_tflops, **run_context(spec))
    header = (
        f"{facts['model']} · {facts['schedule']}: p={facts['p']} dp={facts['dp']} tp={facts['tp']}"
        f"{f' cp={spec.cp}' if spec.cp > 1 else ''}{f' ep={spec.ep}' if spec.ep > 1 else ''}"
        f"{' (sequence parallel)' if facts['sequence_parallel'] else ''} "
        f"{facts['dtype']} on {facts['device']}, ZeRO-{facts['zero']}, "
        f"recomputes {facts['recomputes']}"
    )
    held_out = results[0].eval_losses
    tail = f"\nvalidation loss {held_out[-1][1]:.4f} after {held_out[-1][0]} steps" if held_out else ""
    return header + "\n" + data_line(spec) + "\n" + final_table(results, facts) + tail


def summary(results: Sequence[RankResult], peak_tflops: float | None = None, **context) -> dict:
    """Losses per step, median step time (first step left out when there are more), tokens/s,
    per rank: achieved TFLOP/s and MFU, peak stash bytes, GPU peak memory, bytes sent per step
    (and, with expert parallelism, the all-to-alls' bytes, time, hidden time and expert load),
    static bytes (weights, gradients, optimizer, host) measured and as planned, every tensor the
    rank held by what held it (`census`) and its process's peak resident memory, recomputes over
    the run."""
    from pipeloom.runtime.metrics import median_step, throughput

    first = results[0]
    median = median_step(first)
    ranks = []
    for result in results:
        own = throughput(result, median_step(result), peak_tflops)
        ranks.append(
            {
                "rank": result.rank,
                "median_step_seconds": median_step(result),
                "tflops": own["tflops"],
                "mfu": own["mfu"],
                "peak_stash_bytes": max((r.peak_stash_bytes for r in result.records), default=0),
                "peak_memory_bytes": result.peak_memory_bytes,
                "sent_bytes_per_step": result.records[-1].sent_bytes if result.records else 0,
                "sent_dtypes": list(result.records[-1].sent_dtypes) if result.records else [],
                "tp_sent_bytes_per_step": result.records[-1].tp_sent_bytes if result.records else 0,
                "kv_sent_bytes_per_step": result.records[-1].kv_sent_bytes if result.records else 0,
                **_expert_traffic(result.records[1:] or result.records),
                "static_bytes": result.static_bytes,
                "planned_static_bytes": result.planned_static_bytes,
                "held_bytes": result.held_bytes,
                "peak_host_bytes": result.peak_host_bytes,
            }
        )
    return {
        **context,
        "losses": first.losses,
        "step_seconds": first.step_seconds,
        "median_step_seconds": median if first.step_seconds else None,
        "tokens_per_second": throughput(first, median, None)["tokens_per_second"],
        "sample_tokens": first.sample_tokens,
        "samples_per_step": first.samples_per_step,
        "tflops_per_rank": [rank["tflops"] for rank in ranks],
        "mfu_per_rank": [rank["mfu"] for rank in ranks],
        "peak_tflops": peak_tflops,
        "peak_stash_bytes": [rank["peak_stash_bytes"] for rank in ranks],
        "peak_memory_bytes": [rank["peak_memory_bytes"] for rank in ranks],
        "loss_scales": first.loss_scales,
        "grad_norms": [None if math.isnan(norm) else norm for norm in first.grad_norms],
        "learning_rates": first.learning_rates,
        "eval_losses": [list(pair) for pair in first.eval_losses],
        "recomputes": [sum(r.recomputes for r in result.records) for result in results],
        "ranks": ranks,
    }


def _expert_traffic(records: Sequence) -> dict:
    """Per step (medians over the steps after the first): expert all-to-all bytes sent, time in
    flight and the part of it hidden under an overlapped pair's other op; the last step's tokens
    routed to each expert and their imbalance (busiest expert over the mean, 1 when even)."""
    if not records or not records[-1].expert_tokens:
        return {}
    tokens = list(records[-1].expert_tokens)
    mean = sum(tokens) / len(tokens)
    return {
        "a2a_sent_bytes_per_step": statistics.median(r.a2a_sent_bytes for r in records),
        "a2a_ms_per_step": statistics.median(r.a2a_ms for r in records),
        "a2a_hidden_ms_per_step": statistics.median(r.a2a_ms - r.a2a_exposed_ms for r in records),
        "expert_tokens_per_step": tokens,
        "expert_load_imbalance": max(tokens) / mean if mean else 1.0,
    }


def write_summary(results: Sequence[RankResult], path: str | PathLike[str], peak_tflops=None, **context) -> None:
    with open(path, "w") as handle:
        json.dump(summary(results, peak_tflops, **context), handle, indent=2)


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
