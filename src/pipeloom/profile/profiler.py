"""Measure the real model on this machine and fit per-layer linear models (Mario §5.2).

Each probe trains the LLaMA-style decoder for a few steps with the pipeloom runtime on two forked
gloo ranks, as the plans will run: two stages of n layers each, the first carrying the embedding,
the last the head and loss. Its schedule runs every pass the simulator knows — F, B and W split,
and every other micro-batch checkpointed so that R and a checkpointed F's stash appear too. From
the runtime's records (op start/end, bytes each F and R stashed) it fits, per micro-batch size
and per pass, time = a·n + b_position with one slope a per layer and an intercept for the first
and the last stage (`fit_positions` derives the middle and single ones). Activation bytes are
fitted the same way. A ping between two ranks gives the p2p time of one activation, and the
step time the simulator leaves unexplained (data, all-reduce of the loss, optimizer) is
regressed on the parameters a rank holds.
"""

from __future__ import annotations

import multiprocessing
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.text import parse_op
from pipeloom.models.llama import LlamaConfig, build_stages
from pipeloom.passes.split_backward import split_backward
from pipeloom.schedules.registry import build_schedule
from pipeloom.sim.simulate import simulate
from pipeloom.tune.presets import ModelSpec
from pipeloom.tune.profiled import PROFILE_FORMAT, ProfiledCostModel, fit_positions

__all__ = ["profile_model", "llama_config", "ping_seconds"]

_POSITIONS = {0: "first", 1: "last"}
STATIC_BYTES_PER_PARAM = 16
"""fp32 weights, gradients and AdamW's two moments: what the runtime holds per parameter."""


def llama_config(model: ModelSpec, layers: int, micro_batch: int) -> LlamaConfig:
    return LlamaConfig(
        vocab=model.vocab,
        hidden=model.hidden,
        layers=layers,
        heads=model.heads,
        ffn=model.ffn,
        seq_len=model.seq_len,
        microbatch_size=micro_batch,
    )


def profile_model(
    model: ModelSpec,
    micro_batches: Sequence[int] = (1, 2),
    layer_counts: Sequence[int] = (1, 2, 3),
    steps: int = 6,
    threads: int = 1,
    progress: Callable[[int, int], None] | None = None,
    workload_for: Callable[[int, int], object] | None = None,
    dtype: str = "fp32",
) -> dict:
    """The profile (format ``pipeloom.profile/1``) as a dict. `workload_for(layers, micro-batch
    size)` builds another model to probe (a Hugging Face one: `models.hf.hf_workload`); by
    default it is the built-in LLaMA-style decoder of `model`'s shape."""
    from pipeloom.runtime.local import run_local
    from pipeloom.runtime.training import TrainSpec

    probes = [(mbs, n, 2) for mbs in micro_batches for n in layer_counts]
    runs = []
    for done, (mbs, n, p) in enumerate(probes, 1):
        schedule = probe_schedule(p)
        spec = TrainSpec(
            schedule,
            config=llama_config(model, n * p, mbs),
            steps=steps,
            layer_counts=(n,) * p,
            threads=threads,
            workload=workload_for(n * p, mbs) if workload_for else None,
            dtype=dtype,
        )
        results = run_local(spec)
        runs.append((mbs, n, p, schedule, results))
        if progress:
            progress(done, len(probes) + 1)
    fits = {}
    for mbs in micro_batches:
        samples: dict[str, list[tuple[str, int, float]]] = {}
        for run_mbs, n, _, _, results in runs:
            if run_mbs == mbs:
                for kind, stage, value in _measurements(results):
                    samples.setdefault(kind, []).append((_POSITIONS[stage], n, value))
        fits[str(mbs)] = {kind: fit_positions(points) for kind, points in samples.items()}
        fits[str(mbs)]["p2p_ms"] = _ping_ms((mbs, model.seq_len, model.hidden))
    if progress:
        progress(len(probes) + 1, len(probes) + 1)
    profile = {
        "format": PROFILE_FORMAT,
        "model": model.to_dict(),
        "device": f"cpu, {threads} thread(s) per rank, {dtype}",
        "dtype": dtype,
        "micro_batch_sizes": list(micro_batches),
        "fits": fits,
        "params": _params(model, workload_for),
        "static_bytes_per_param": STATIC_BYTES_PER_PARAM,
        "p2p_bandwidth": _bandwidth(model, micro_batches[0], fits[str(micro_batches[0])]["p2p_ms"]),
    }
    profile["step_overhead"] = _step_overhead(profile, runs)
    return profile


def probe_schedule(p: int) -> Schedule:
    """1F1B over 4 micro-batches, backward split, odd micro-batches checkpointed (R inside B)."""
    split = split_backward(build_schedule("1f1b", p, 4), "after")
    devices = []
    for ops in split.devices:
        out = []
        for op in ops:
            odd = op.microbatch % 2 == 1
            if op.kind is OpKind.F and odd:
                out.append(Op(OpKind.F, op.stage, op.microbatch, ckpt=True))
                continue
            if op.kind is OpKind.B and odd:
                out.append(Op(OpKind.R, op.stage, op.microbatch, after_grad=True))
            out.append(op)
        devices.append(out)
    return split.with_devices(devices, name="probe")


def _measurements(results) -> list[tuple[str, int, float]]:
    """(kind, stage, value): median op times (ms) after the first step, and stashed bytes."""
    out = []
    for rank, result in enumerate(results):
        times: dict[str, list[float]] = {}
        for record in result.records[1:] or result.records:
            for text, start, end in record.ops:
                op = parse_op(text)
                if op.kind is not OpKind.R and op.microbatch % 2:
                    continue  # a checkpointed micro-batch's backward follows its recompute: time plain ones
                times.setdefault(op.kind.value, []).append(1e3 * (end - start))
        out += [(kind, rank, statistics.median(values)) for kind, values in times.items()]
        entries = result.records[-1].entry_bytes
        plain = [v for text, v in entries.items() if "F" in text and not text.endswith("c")]
        kept = [v for text, v in entries.items() if "F" in text and text.endswith("c")]
        out += [("M_B", rank, statistics.median(plain)), ("M_ckpt", rank, statistics.median(kept))]
    return out


def _params(model: ModelSpec, workload_for=None) -> dict:
    """Parameters of one decoder layer, of the first stage's extras (embeddings) and of the last
    stage's (final norm and head; a tied head counts on both ends, as each end holds a copy)."""
    if workload_for is None:
        stage = build_stages(llama_config(model, 1, 1), 1, seed=0)[0]
    else:
        stage = workload_for(1, 1).build(1)[0]

    def count(*modules) -> int:
        return sum(t.numel() for module in modules if module is not None for t in module.parameters())

    first = count(stage.embed, getattr(stage, "positions", None))
    return {"layer": count(stage.layers[0]), "first": first, "last": count(stage.norm, stage.head)}


def _bandwidth(model: ModelSpec, micro_batch: int, p2p_ms: float) -> float:
    """Bytes per ms of one p2p transfer of fp32 activations."""
    return 4 * micro_batch * model.seq_len * model.hidden / max(p2p_ms, 1e-6)


def _step_overhead(profile: dict, runs) -> dict:
    """Measured step − simulated pipeline, as ms = base + per_param · parameters on the rank."""
    model = ProfiledCostModel(profile)
    points = []
    for mbs, n, p, schedule, results in runs:
        costs = model.stage_costs([n] * p, mbs, p, 1)
        simulated = simulate(schedule, costs).makespan
        measured = 1e3 * statistics.median(results[0].step_seconds[1:] or results[0].step_seconds)
        params = max(model.stage_params([n] * p))
        points.append((params, measured - simulated))
    mean_x = statistics.fmean(x for x, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread if spread else 0.0
    slope = max(slope, 0.0)
    return {"base_ms": max(0.0, mean_y - slope * mean_x), "per_param_ms": slope}


def _ping_ms(shape: tuple[int, ...], repeats: int = 20) -> float:
    """Median one-way time of an fp32 tensor of `shape` between two forked gloo ranks."""
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="pipeloom-ping-") as directory:
        processes = [context.Process(target=_ping_rank, args=(r, directory, shape, repeats)) for r in range(2)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(60)
        return float(Path(directory, "ping").read_text())


def ping_seconds(rank: int, tensor: torch.Tensor, repeats: int = 5) -> float:
    """Median one-way time of `tensor` between ranks 0 and 1 of the current group (other ranks
    only join the barriers)."""
    samples = []
    for _ in range(repeats):
        dist.barrier()
        began = time.perf_counter()
        if rank == 0:
            dist.send(tensor, 1)
            dist.recv(tensor, 1)
        elif rank == 1:
            dist.recv(tensor, 0)
            dist.send(tensor, 0)
        samples.append((time.perf_counter() - began) / 2)
    return statistics.median(samples)


def _ping_rank(rank: int, directory: str, shape: tuple[int, ...], repeats: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=2)
    seconds = ping_seconds(rank, torch.zeros(shape), repeats)
    if rank == 0:
        Path(directory, "ping").write_text(str(1e3 * seconds))
    dist.destroy_process_group()
