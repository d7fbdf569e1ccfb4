"""The one runner of the profile's probes, and a probe's rounds turned into measurements: op
times, stashed bytes, exchanges and step phases.

Every probe — of any layout: two stages, slices, a stage over tp ranks, dp replicas, replicas
sharing out experts — is a TrainSpec of `ProbeModel`, run in rounds of a few steps by
`run_by_turns` under one policy (`Turns`); `samples` reads one round, `Series` decides when the
rounds have settled, and `steady_probe` measures the probe over the steps that ran at the
machine's own speed (`steadiness`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from itertools import compress
from typing import Any

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.text import parse_op
from pipeloom.models.llama import llama_config
from pipeloom.passes.split_backward import split_backward
from pipeloom.profile.speed import op_ratios
from pipeloom.profile.steadiness import (
    WARMUP_STEPS,
    Contention,
    Measured,
    Series,
    steady_rounds,
    step_busy,
    timed_steps,
)
from pipeloom.schedules.registry import build_schedule
from pipeloom.tune.presets import ModelSpec

__all__ = [
    "OP_KINDS",
    "PHASES",
    "Probe",
    "ProbeModel",
    "Turns",
    "measure_probes",
    "probe_schedule",
    "run_by_turns",
    "samples",
    "steady_probe",
    "steady_records",
]

OP_KINDS = ("F", "B", "W", "BW", "F_BW", "R")
"""Ops timed: F_BW is the forward of a micro-batch whose backward is fused (its linears ordinary,
with nothing to keep for a W)."""
PHASES = ("pipeline", "allreduce", "optimizer", "overhead")
PROBE_MICRO_BATCHES = 5
FUSED_MICRO_BATCH = 3
"""The probe's micro-batch whose backward is one autograd pass (a BW), and whose F is then its
own kind (F_BW): neither the first F of a rank (cold) nor the checkpointed last, so the others
keep every sampled F, B and W."""
SETTLED_MS = 0.1
"""A median that moves by less than this (ms) has settled, however small it is."""


@dataclass(frozen=True)
class Probe:
    """One probe's measurements over its steady steps: "kind@rank" → Measured; its schedule; per
    rank, its time in ops (ms) in each steady step; the share of its timed steps that were steady
    (`steadiness.steady_steps`)."""

    schedule: Schedule
    values: dict[str, Measured]
    busy: list[list[float]]
    steady: float

    def median(self, key: str) -> float:
        return self.values[key].median

    @property
    def spread(self) -> float:
        """The noisiest op time's spread."""
        return max((m.spread for key, m in self.values.items() if key.split("@")[0] in OP_KINDS), default=0.0)

    @property
    def rounds(self) -> int:
        return max(m.rounds for m in self.values.values())


def probe_schedule(p: int, slices: int = 1) -> Schedule:
    """1F1B over 5 micro-batches, backward split, the last micro-batch checkpointed (its R inside
    its B). Only one: a plan's Fs stash (a checkpointed F, stashing nothing, runs faster), and
    those sampled must not be outnumbered by each step's first op, which runs cold (`samples`,
    `docs/fidelity.md`). One micro-batch's backward is fused (`FUSED_MICRO_BATCH`: a BW, one
    autograd pass, as the runtime runs a W that nothing would fill the gap before; `Costs.BW`),
    the other split ones as many as the probe had before it was measured. With `slices`, each
    micro-batch's sequence in that many causal slices, as svpp and terapipe run them: a
    micro-batch's F slice by slice, then its backward from the last slice to the first, each
    slice's R, B and W together (a slice's B sends the gradients of the keys and values it read
    back to the earlier slices' stash)."""
    split = split_backward(build_schedule("1f1b", p, PROBE_MICRO_BATCHES), "after")
    devices = []
    for ops in split.devices:
        out = []
        for op in ops:
            checkpointed = op.microbatch == PROBE_MICRO_BATCHES - 1
            if op.kind is OpKind.F:
                out += [Op(OpKind.F, op.stage, op.microbatch, slice=k, ckpt=checkpointed) for k in range(slices)]
            elif op.kind is OpKind.W:  # the micro-batch's backward, its last slice first
                for k in reversed(range(slices)):
                    if checkpointed:
                        out.append(Op(OpKind.R, op.stage, op.microbatch, slice=k, after_grad=True))
                    if op.microbatch == FUSED_MICRO_BATCH:
                        out.append(Op(OpKind.BW, op.stage, op.microbatch, slice=k))
                        continue
                    out += [
                        Op(OpKind.B, op.stage, op.microbatch, slice=k),
                        Op(OpKind.W, op.stage, op.microbatch, slice=k),
                    ]
        devices.append(out)
    return replace(split.with_devices(devices, name="probe"), num_slices=slices)


@dataclass(frozen=True)
class ProbeModel:
    """What every probe trains: `model`'s decoder, or `workload_for(layers, micro-batch size)`'s
    model (a Hugging Face one), `steps` timed steps a round (after `steadiness.WARMUP_STEPS` of
    warm-up: a probe timing one step a round is at the mercy of that step) on `threads` threads a
    rank, in `dtype`, on `device` (None: the CPU)."""

    model: ModelSpec | None
    steps: int
    threads: int = 1
    workload_for: Callable[[int, int], Any] | None = None
    dtype: str = "fp32"
    device: str | None = None

    def spec(self, mbs: int, layers: int, stages: int = 2, schedule: Schedule | None = None, **parallel: Any):
        """A run of `stages` stages of `layers` layers at micro-batch size `mbs`: by default the
        probe schedule (`probe_schedule`, its micro-batches in `slices`), each W right after its B
        (timed apart, not folded into it); `parallel`: the TrainSpec's layout (tp,
        sequence_parallel, dp, zero, ep, slices)."""
        from pipeloom.runtime.training import TrainSpec

        slices = parallel.pop("slices", 1)
        model = (
            {"workload": self.workload_for(layers * stages, mbs)}
            if self.workload_for
            else {"config": llama_config(self.model, layers * stages, mbs)}
        )
        return TrainSpec(
            schedule or probe_schedule(stages, slices),
            **model,
            steps=self.steps + WARMUP_STEPS,
            layer_counts=(layers,) * stages,
            threads=self.threads,
            dtype=self.dtype,
            separate_w=schedule is None,
            device=self.device,
            **parallel,
        )


@dataclass(frozen=True)
class Turns:
    """How probes take their rounds (`run_by_turns`): a round of each at a time, so a slow spell
    of the machine falls on one round of several probes, not every round of one; each again until
    its medians settle (`steadiness.Series`), at least `min_rounds` and at most `max_rounds`
    rounds. A round `busy` finds contended is dropped and run again (`Contention` refuses once
    the machine stays busy; None: not judged — a GPU's ops, or ops that wait inside their
    collectives). `in_process`: every rank in this process (`run_probe`)."""

    max_rounds: int = 4
    min_rounds: int = 1
    busy: Contention | None = None
    tick: Callable[[], None] = lambda: None
    in_process: bool = False

    def fixed(self, rounds: int) -> Turns:
        """Exactly `rounds` rounds, settled or not, outside the progress count."""
        return replace(self, max_rounds=rounds, min_rounds=rounds, tick=lambda: None)


def run_by_turns(specs: dict, turns: Turns) -> tuple[dict[Any, list], dict[Any, Series]]:
    """Each spec's rounds (key → its rounds' results), taken by `turns`, and the series that
    decided when each had settled."""
    from pipeloom.runtime.probe import probe_spec

    # the same boundaries every forked round (a run in process probes its own)
    probes = {key: None if turns.in_process else probe_spec(spec) for key, spec in specs.items()}
    series = {key: Series(floor=SETTLED_MS) for key in specs}
    rounds: dict[Any, list] = {key: [] for key in specs}

    def wanted(key) -> bool:
        done = len(rounds[key])
        return done < turns.max_rounds and (done < turns.min_rounds or not series[key].settled)

    while todo := [key for key in specs if wanted(key)]:
        for key in todo:
            results = run_probe(specs[key], probes[key], turns.in_process)
            while turns.busy is not None and not turns.busy.clean_round(results):
                results = run_probe(specs[key], probes[key], turns.in_process)
            series[key].add(samples(results))
            rounds[key].append(results)
            turns.tick()
    return rounds, series


def measure_probes(specs: dict, turns: Turns, op_variation: list[float]) -> dict[tuple[int, int], Probe]:
    """The probes (micro-batch size, layers per stage) → their TrainSpec, run by `turns` and
    measured over their steady steps (`steady_probe`); each op's own variation
    (`speed.op_ratios`) goes into `op_variation`."""
    rounds, series = run_by_turns(specs, turns)
    return {key: steady_probe(specs[key].schedule, rounds[key], series[key], op_variation) for key in specs}


def run_probe(spec, probe=None, in_process: bool = False) -> list:
    """One round of a probe: its ranks forked (`run_local`, as plans run on CPU ranks), or all in
    this process (`run_in_process`: every stage on the one GPU, as a plan runs there, the ops timed
    by the device's events). Its results without the weights and gradients, which nothing here
    reads: every round's results are kept until the last, and ranks forked from a process holding
    more memory run slower."""
    if in_process:
        from pipeloom.runtime.in_process import run_in_process

        results = run_in_process(spec)
    else:
        from pipeloom.runtime.local import run_local

        results = run_local(spec, probe=probe)
    return [replace(result, parameters={}, gradients={}) for result in results]


def steady_probe(schedule: Schedule, rounds: list, series: Series, op_variation: list[float]) -> Probe:
    """The probe measured over its steady steps only (`steadiness.steady_steps`, over every round):
    its rounds decided when it had settled, but which of their steps fell in a slow spell of the
    machine is luck, which would move the medians."""
    kept_steps, kept = steady_records(rounds)
    steady = Series(floor=SETTLED_MS)
    for results, kept_flags in zip(rounds, kept_steps):
        if any(kept_flags):
            steady.add(samples(results, kept_flags))
    busy = []  # per rank, its time in ops each kept step, every round's together; and each op's own variation
    for rounds_kept in kept:
        busy.append([time for records in rounds_kept for time in step_busy(records)])
        op_variation.extend(ratio for records in rounds_kept for ratio in op_ratios(records))
    measured = {key: replace(m, rounds=series.rounds, stable=series.settled) for key, m in steady.measured().items()}
    return Probe(schedule, measured, busy, sum(map(sum, kept_steps)) / sum(map(len, kept_steps)))


def steady_records(rounds: list) -> tuple[list[list[bool]], list[list[list]]]:
    """Per round (its ranks' results), which of its timed steps every rank ran at the machine's
    own speed (`steadiness.steady_rounds`, judged over every round together); and per rank, per
    round, those steps' records."""
    ranks = range(len(rounds[0]))
    flags = steady_rounds([[step_busy(timed_steps(results[rank].records)) for rank in ranks] for results in rounds])
    kept = [[_kept(timed_steps(results[rank].records), keep) for results, keep in zip(rounds, flags)] for rank in ranks]
    return flags, kept


def _kept(steps: list, kept: Sequence[bool] | None) -> list:
    return steps if kept is None else list(compress(steps, kept))


def samples(results, kept: Sequence[bool] | None = None) -> dict[str, list[float]]:
    """One round's samples, its warm-up left out (and the steps not `kept`): op times (ms) by
    "kind@rank" — a fused backward's F as F_BW (its linears ordinary); not a checkpointed F's,
    nor each step's first op's (it runs cold, once a step however many ops a plan runs: the
    per-op overhead, fitted to whole pipelines, carries it) — stashed bytes ("M_B@rank",
    "M_ckpt@rank"), the bytes a B leaves queued for its W ("M_W@rank") and rank 0's step phases
    (ms). Where experts are shared out, each op's time is its compute, and the all-to-alls in
    flight in it are apart ("a2a_F@rank", "a2a_B@rank")."""
    out: dict[str, list[float]] = {}
    for rank, result in enumerate(results):
        ops = [parse_op(text) for text, _, _ in result.records[-1].ops]  # every step runs the same
        fused = {op.key for op in ops if op.kind is OpKind.BW}
        for record in _kept(timed_steps(result.records), kept):
            exchange = _exchange_per_op(record)
            for index, (op, (_, start, end)) in enumerate(zip(ops, record.ops)):
                if op.ckpt or index == 0:
                    continue  # a checkpointed F stashes nothing; the step's first op starts cold
                kind = "F_BW" if op.kind is OpKind.F and op.key in fused else op.kind.value
                out.setdefault(f"{kind}@{rank}", []).append(1e3 * (end - start) - exchange.get(op.kind, 0.0))
            if exchange:
                out.setdefault(f"a2a_F@{rank}", []).append(exchange[OpKind.F])
                out.setdefault(f"a2a_B@{rank}", []).append(exchange[OpKind.B])
        stashed = [
            (op.ckpt, v)
            for text, v in result.records[-1].entry_bytes.items()
            if (op := parse_op(text)).kind is OpKind.F and op.key not in fused
        ]
        out[f"M_B@{rank}"] = [v for checkpointed, v in stashed if not checkpointed]
        out[f"M_ckpt@{rank}"] = [v for checkpointed, v in stashed if checkpointed]
        out[f"M_W@{rank}"] = [float(v) for v in result.records[-1].pending_w_bytes.values()]
    for phases in _kept(timed_steps(results[0].phase_seconds), kept):
        for phase in PHASES:
            out.setdefault(phase, []).append(1e3 * phases[phase])
    return out


def _exchange_per_op(record) -> dict[OpKind, float]:
    """The ms of expert all-to-alls in flight in each forward (F, R) and backward (B, BW) op of
    a step: the step's, shared evenly, every forward (or backward) crossing the same layers'
    exchanges; {} where no experts were shared out."""
    if not getattr(record, "a2a_ms", 0.0):
        return {}
    kinds = [parse_op(text).kind for text, _, _ in record.ops]
    forwards = sum(kind in (OpKind.F, OpKind.R) for kind in kinds)
    backwards = sum(kind in (OpKind.B, OpKind.BW) for kind in kinds)
    forward = record.a2a_forward_ms / forwards if forwards else 0.0
    backward = (record.a2a_ms - record.a2a_forward_ms) / backwards if backwards else 0.0
    return {OpKind.F: forward, OpKind.R: forward, OpKind.B: backward, OpKind.BW: backward}
