"""bench/fidelity.py's table: each plan's step as `tune` predicted it from the profile taken before
its runs against those runs, the MAPEs, and why a plan missed."""

from __future__ import annotations

import statistics
from itertools import compress

from fidelity_measures import PHASES, replayed, replayed_by_round, steady, traffic, why

from pipeloom.profile.steadiness import Series, timed_steps
from pipeloom.runtime.layout import RankLayout
from pipeloom.runtime.plan_run import last_pipeline_phases


def report(rows: list, explain_above: float) -> None:
    width = max(len(row.label) for row in rows) + 1
    header = f"{'plan':<{width}} {'step ms':>8} {'measured':>8} {'bias':>7}  "
    print(header + "  ".join(f"{p[:8]:>13}" for p in PHASES) + "   stash MiB (pred/meas) per device")
    errors: dict[str, list[float]] = {"time": [], "memory": [], "simulator": [], "bias": []}
    explained, traffics, shares = [], [], []
    within: list[bool] = []
    noises: list[float] = []
    for row in rows:
        plan, rounds = row.plan, row.runs
        series = Series()
        layout = RankLayout(plan.pp, plan.dp * plan.cp, plan.tp, plan.cp)
        kept = steady(rounds)
        shares.append(sum(map(sum, kept)) / sum(map(len, kept)))
        for results, flags in zip(rounds, kept):
            pipeline_ranks = [results[layout.rank(0, d)] for d in range(plan.pp)]
            phases = list(compress(timed_steps(last_pipeline_phases(pipeline_ranks)), flags))
            series.add(
                {"step": [1e3 * s for s in compress(timed_steps(results[0].step_seconds), flags)]}
                | {p: [1e3 * step[p] for step in phases] for p in PHASES}
            )
        measured_parts = series.measured()
        measured = measured_parts["step"].median
        predicted = plan.predicted["step_time_ms"]
        errors["time"].append(abs(measured - predicted) / measured)
        # about 95 % each: the profile's band around the prediction, two standard errors of the measured median
        noise = (
            plan.predicted.get("band_ms", 0.0) ** 2 + (2 * measured_parts["step"].relative_error * measured) ** 2
        ) ** 0.5 / measured
        within.append(errors["time"][-1] <= noise)
        noises.append(noise)
        errors["bias"].append((predicted - measured) / measured)
        parts = [f"{plan.predicted.get(p + '_ms', 0.0):6.1f}/{measured_parts[p].median:<6.1f}" for p in PHASES]
        cells = []
        for device, expected in enumerate(plan.predicted["peak_activation_memory"]):
            stash = max(
                r.peak_stash_bytes
                for replica in range(plan.dp * plan.cp)
                for r in rounds[-1][layout.rank(replica, device)].records
            )
            errors["memory"].append(abs(stash - expected) / stash)
            cells.append(f"{expected / 2**20:.1f}/{stash / 2**20:.1f}")
        print(
            f"{row.label:<{width}} {predicted:>8.1f} {measured:>8.1f} {errors['bias'][-1]:>+7.1%}  "
            + "  ".join(parts)
            + "   "
            + "  ".join(cells)
        )
        again = replayed(plan, rounds, layout, kept)  # where the time went, over every round's ops together
        # the simulator alone: each round's own op times replayed, the plan's the rest
        alone = predicted + replayed_by_round(plan, rounds, layout, kept) - again.predicted
        errors["simulator"].append(abs(alone - measured) / measured)
        if errors["time"][-1] > explain_above:
            explained.append(f"{row.label}: {why(plan, rounds, measured_parts, measured, again)}")
        if moved := traffic(plan, rounds):  # collectives' bytes or all-to-all time, read once
            traffics.append(f"{row.label}: {moved}")
    mape = {key: statistics.fmean(values) for key, values in errors.items()}
    print("step ms, the phases and stash: predicted by tune from the profile taken before the runs")
    print(
        "breakdown columns: predicted/measured ms (medians over the steady steps, each step's phases on the rank "
        f"whose pipeline ended last; steady: {statistics.median(shares):.0%} of a plan's steps, the rest ran in slow "
        f"spells); {len(rows)} plans"
    )
    print("\n".join(f"  {line}" for line in traffics))
    print(f"per plan |error|: {', '.join(f'{e:.1%}' for e in errors['time'])}")
    print(f"per plan |error| of the simulator alone: {', '.join(f'{e:.1%}' for e in errors['simulator'])}")
    print(
        f"per plan noise (the profile's band and two standard errors of the measured median, together): "
        f"{', '.join(f'±{n:.1%}' for n in noises)}; {sum(within)} of {len(rows)} plans missed by no more than that"
    )
    print(
        f"MAPE: step time {mape['time']:.1%} (goal ≤ 5%: {'met' if mape['time'] <= 0.05 else 'missed'}; the "
        f"machine's drift since the profile included), bias {mape['bias']:+.1%} (predicted over measured, mean), "
        f"memory {mape['memory']:.2%} (goal ≤ 2%: {'met' if mape['memory'] <= 0.02 else 'missed'})"
    )
    print(
        f"the simulator alone (each round's own op times replayed, the rest as predicted; the median over rounds, "
        f"as the measured step's): MAPE "
        f"{mape['simulator']:.1%} (goal ≤ 2%: {'met' if mape['simulator'] <= 0.02 else 'missed'}) — the rest of "
        "the error is the op times' (the profile against the runs)"
    )
    if explained:
        print(f"\nwhy each plan missed by more than {explain_above:.0%} (shares of its measured step):")
        print("\n".join(f"  {line}" for line in explained))
