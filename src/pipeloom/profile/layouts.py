"""Every layout's probes, measured one way: run by the probe runner, fitted by one fit.

A layout (`profile_format.Layout`) is how a probe's ranks share its stage. The plain probes run
two stages of n layers, the first with the embedding and the last with the head and loss (with
`--slices`, each micro-batch in slices); a tensor-parallel layout runs one stage over tp ranks;
an expert-parallel one, one stage over ep data-parallel replicas that share out its experts; a
context-parallel one, one stage over cp ranks each holding its share of every sequence.
Each runs the probe schedule (`probe_rounds.probe_schedule`) at every micro-batch size and layer
count, and each pass, stash and exchange is fitted as value = slope·n + intercept[position]
(`fit_positions`), at the positions the layout's stages hold: first and last, or the single
one. A layout's ops are its own, the waits inside their collectives included (where experts are
shared out, the all-to-alls in flight fitted apart: `probe_rounds.samples`), which nothing in the
plain ops predicts (`docs/fidelity.md`); its speed and confidence are its own too. The
replicas' wait at the gradient sync is measured on two replicas of one stage, as how far the
later one's pipeline ends past the two's mean (`replica_wait`).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace
from itertools import compress
from typing import Any

from pipeloom.profile.probe_rounds import (
    OP_KINDS,
    Probe,
    ProbeModel,
    Turns,
    measure_probes,
    run_by_turns,
    steady_records,
)
from pipeloom.profile.speed import speed_of
from pipeloom.profile.steadiness import timed_steps
from pipeloom.profile_format import Fit, Layout, LayoutProfile, ReplicaWait
from pipeloom.schedules.registry import build_schedule
from pipeloom.tune.profile_fits import fit_positions

__all__ = ["EP", "REPLICA_ROUNDS", "layout_spec", "measure_layout", "replica_wait", "replica_waits"]

EP = 2
"""The expert-parallel group the profile measures: two ranks, one all-to-all partner each."""
REPLICA_ROUNDS = 3
"""Rounds of the replicas' probes, by turns: a slow spell falls on one round of each."""


def measure_layout(
    layout: Layout, probed: ProbeModel, micro_batches: Sequence[int], layer_counts: Sequence[int], turns: Turns
) -> tuple[LayoutProfile, dict[tuple[int, int], Probe]]:
    """`layout`'s probes (micro-batch size, layers a stage) run by `turns` and fitted; and the
    probes. Ops on tp, ep or cp ranks wait inside their collectives by design, so no round of
    theirs is judged busy by its wall against CPU time."""
    specs = {(mbs, n): layout_spec(layout, probed, mbs, n) for mbs in micro_batches for n in layer_counts}
    op_variation: list[float] = []
    measured = measure_probes(specs, turns if layout.stages == 2 else replace(turns, busy=None), op_variation)
    busy = (steps for probe in measured.values() for steps in probe.busy)
    return (
        LayoutProfile(
            fits=fits(measured, micro_batches, layout.stages),
            speed=speed_of(busy, op_variation),
            confidence=confidence(measured, micro_batches),
            layers=tuple(sorted(set(layer_counts))),
        ),
        measured,
    )


def layout_spec(layout: Layout, probed: ProbeModel, mbs: int, layers: int):
    """The TrainSpec of `layout`'s probe at micro-batch size `mbs` and `layers` a stage."""
    parallel: dict[str, Any] = {"slices": layout.slices}
    if layout.tp > 1:
        parallel = {"stages": 1, "tp": layout.tp, "sequence_parallel": layout.sequence_parallel}
    elif layout.ep > 1:
        parallel = {"stages": 1, "dp": layout.ep, "ep": layout.ep}
    elif layout.cp > 1:
        parallel = {"stages": 1, "cp": layout.cp}
    return probed.spec(mbs, layers, **parallel)


def fits(measured: dict[tuple[int, int], Probe], micro_batches: Sequence[int], stages: int) -> dict:
    """Micro-batch size → kind → Fit over the probes' layer counts, each rank's medians at its
    stage's position (the first rank of each stage; the others are its tp, ep or cp peers) — of
    the bytes a stage holds, its fullest peer's, whose peak a plan's device reaches (experts
    shared out hold as many tokens as are routed to them); of a one-stage layout, its sync
    phase too ("sync": what its ranks sum after the pipeline)."""
    positions = {0: "single"} if stages == 1 else {0: "first", 1: "last"}
    out = {}
    for mbs in micro_batches:
        points: dict[str, list[tuple[str, int, float]]] = {}
        for (size, n), probe in measured.items():
            for key in probe.values if size == mbs else ():
                kind, _, rank = key.partition("@")
                if rank and int(rank) in positions:
                    value = probe.median(key)
                    if kind.startswith("M_") and stages == 1:
                        value = max(m.median for k, m in probe.values.items() if k.partition("@")[0] == kind)
                    points.setdefault(kind, []).append((positions[int(rank)], n, value))
                elif key == "allreduce" and stages == 1:
                    points.setdefault("sync", []).append(("single", n, probe.median(key)))
        out[mbs] = {kind: Fit(**fit_positions(points[kind])) for kind in points}
    return out


def confidence(measured: dict[tuple[int, int], Probe], micro_batches: Sequence[int]) -> dict[int, dict[str, float]]:
    """Per micro-batch size and op kind, the relative standard error of the probes' medians (the
    median over the probes and ranks that measured it): `tune` turns it into a plan's band."""
    out: dict[int, dict[str, float]] = {}
    for mbs in micro_batches:
        errors: dict[str, list[float]] = {}
        for (size, _), probe in measured.items():
            for key, value in probe.values.items() if size == mbs else ():
                if (kind := key.split("@")[0]) in OP_KINDS:
                    errors.setdefault(kind, []).append(value.relative_error)
        out[mbs] = {kind: statistics.median(values) for kind, values in errors.items()}
    return out


def replica_waits(layout: Layout, probed: ProbeModel, mbs: int, layers: int, turns: Turns) -> dict[int, ReplicaWait]:
    """ZeRO-0 → the wait on two replicas of one stage of `layers` layers at micro-batch size
    `mbs` (1F1B over 4 micro-batches), steady steps only: of the plain layout, or of the
    expert-parallel one (its replicas sharing out the experts, whose exchanges wait: no round
    judged busy). The skew is the pipelines', so one ZeRO level measures it for every level."""
    schedule = build_schedule("1f1b", 1, 4)
    shared = {"dp": layout.ep, "ep": layout.ep} if layout.ep > 1 else {"dp": 2}
    spec = probed.spec(mbs, layers, stages=1, schedule=schedule, **shared)
    rounds, _ = run_by_turns({0: spec}, replace(turns, busy=None) if layout.ep > 1 else turns)
    return {0: replica_wait(rounds[0], steady_records(rounds[0])[0], layers)}


def replica_wait(rounds: list, kept: list[list[bool]], layers: int) -> ReplicaWait:
    """Over the steps `kept` of `rounds` (two replicas' results each), the medians in ms of rank
    0's pipeline, of half the two pipelines' difference (how far the later one ends past their
    mean) and of rank 0's rest of a step (the wait at the loss's all-reduce for the other's
    optimizer step included, as a step with replicas pays it)."""
    pipelines, skews, rests = [], [], []
    for results, flags in zip(rounds, kept):
        steps = zip(*(compress(timed_steps(result.phase_seconds), flags) for result in results[:2]))
        for first, second in steps:
            pipelines.append(1e3 * first["pipeline"])
            skews.append(1e3 * abs(first["pipeline"] - second["pipeline"]) / 2)
            rests.append(1e3 * first["overhead"])
    median = statistics.median
    return ReplicaWait(median(pipelines), layers, median(skews), median(rests))
