"""What bench/fidelity.py reads from a plan's runs: its steady steps, its replay through the
simulator, where its prediction missed, and what its collectives moved."""

from __future__ import annotations

import statistics

from pipeloom.profile.probe_rounds import PHASES, steady_records
from pipeloom.profile.steadiness import BUSY, timed_steps, wall_over_cpu
from pipeloom.sim.replay import replay_records


def steady(rounds: list) -> list[list[bool]]:
    """Per round, which of its timed steps (warm-up left out) every rank ran at the machine's own
    speed (`probe_rounds.steady_records`): the profile's medians are over such steps,
    so the measured ones are too — which steps fell in a slow spell is luck (`profile.steadiness`)."""
    return steady_records(rounds)[0]


def replayed(plan, rounds: list, layout, kept: list[list[bool]]):
    """The plan's schedule simulated with its runs' own op times (`sim.replay`, replica 0's
    devices, the `kept` steps of every round together)."""
    return replay_records(plan.schedule, plan.costs, _kept_steps(plan, rounds, layout, kept))


def replayed_by_round(plan, rounds: list, layout, kept: list[list[bool]]) -> float:
    """The median over rounds of each round's own op times replayed (`replayed`, one round at a
    time): what the simulator predicts from each run's ops, taken as the measured step is — the
    median of the rounds' medians — so that a drift of the machine from round to round moves
    both sides alike."""
    makespans = [
        replay_records(plan.schedule, plan.costs, steps).replayed
        for results, flags in zip(rounds, kept)
        if (steps := _kept_steps(plan, [results], layout, [flags]))
    ]
    return statistics.median(makespans)


def _kept_steps(plan, rounds: list, layout, kept: list[list[bool]]) -> list[list]:
    """The `kept` steps of `rounds`, each as replica 0's devices' records of it."""
    steps = []
    for results, flags in zip(rounds, kept):
        timed = [timed_steps(results[layout.rank(0, d)].records) for d in range(plan.pp)]
        steps += [[records[k] for records in timed] for k, flag in enumerate(flags) if flag]
    return steps


def why(plan, rounds: list, measured_parts: dict, measured_step: float, again) -> str:
    """Where a plan's prediction missed: how busy the machine was, the pipeline's error split into
    op times and runtime (`again`: its replay), then each phase that missed by 1 % of the step."""
    busy = statistics.median(wall_over_cpu(results) for results in rounds)
    waits = plan.tp > 1 or plan.cp > 1 or "a2a_ms" in plan.predicted  # collectives inside the ops: waiting is theirs
    note = " (their collectives wait inside them)" if waits else " (busy: other processes took the cores)"
    parts = [f"ops ran at {busy:.2f}× their CPU time{note if busy > BUSY else ''}"]
    noise = plan.predicted.get("speed_noise_ms", 0.0)
    parts.append(again.explain(measured_step, noise))
    for phase in PHASES[1:]:
        gap = measured_parts[phase].median - plan.predicted.get(phase + "_ms", 0.0)
        if abs(gap) >= 0.01 * measured_step:
            parts.append(
                f"{phase} {gap / measured_step:+.1%} ({plan.predicted.get(phase + '_ms', 0.0):.1f} → "
                f"{measured_parts[phase].median:.1f} ms)"
            )
    return "; ".join(parts)


def traffic(plan, rounds: list) -> str:
    """What a tensor-, context- or expert-parallel plan moves besides the pipeline's messages,
    predicted/measured."""
    records = [r for results in rounds for result in results for r in timed_steps(result.records)]
    if "tp_sent_bytes" in plan.predicted:
        measured = max(r.tp_sent_bytes for r in records)
        return (
            f"TP collectives {plan.predicted['tp_sent_bytes'] / 2**20:.2f}/{measured / 2**20:.2f} MiB a step per rank"
        )
    if "kv_sent_bytes" in plan.predicted:
        measured = max(r.kv_sent_bytes for r in records)
        return f"K/V exchanges {plan.predicted['kv_sent_bytes'] / 2**20:.2f}/{measured / 2**20:.2f} MiB a step per rank"
    if "a2a_ms" in plan.predicted:
        measured = statistics.median(r.a2a_ms for r in records)
        return f"expert all-to-alls {plan.predicted['a2a_ms']:.1f}/{measured:.1f} ms in flight a step"
    return ""
