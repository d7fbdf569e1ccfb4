"""Expert-parallel op times, measured: one stage of a mixture of experts trained by two replicas
that share out its experts (--ep 2), every MoE layer's dispatch and combine an all-to-all.

The tp = 1 probes time each layer with all its experts on one rank; sharing them out adds the
exchanges, the dispatch's bookkeeping (counting, ordering and splitting the tokens by expert) and
each rank's experts over both replicas' tokens, none of which follows from those times. So a
profile of a mixture of experts measures the layout (`expert_exchange`): the exchanges' time in
flight, an F's and a BW's whole time and an F's stash, which `tune.profiled.ProfiledCostModel`
takes as the difference from the tp = 1 fits. As on tp ranks (`tp_probes`), the ops wait inside
their collectives, which makes them vary more from step to step and skews them, so the layout keeps
its own speed (`speed.speed_of`), which `tune.speed_noise` draws from for its plans;
and its medians are over steady steps only (`probe_rounds.steady_records`), as the plans' are measured.
"""

from __future__ import annotations

import statistics

from pipeloom.ir.ops import OpKind
from pipeloom.ir.text import parse_op
from pipeloom.profile.probe_rounds import ProbeModel, Turns, run_by_turns, speed_samples, stashed_bytes, steady_records
from pipeloom.profile.replica_skew import step_tail
from pipeloom.profile.speed import speed_of
from pipeloom.profile_format import ExpertExchange, LayoutProfile
from pipeloom.schedules.registry import build_schedule

__all__ = ["EP", "expert_exchange"]

EP = 2
"""The expert-parallel group the profile measures: two ranks, one all-to-all partner each."""


def expert_exchange(probed: ProbeModel, micro_batches, layers: int, turns: Turns) -> LayoutProfile:
    """The expert-parallel layout (`Layout(ep=EP)`): a mixture of experts' dispatch and combine,
    per MoE layer and micro-batch size, and the layout's speed (`speed.speed_of`). Measured on
    one stage of `layers` layers trained by two data-parallel replicas that share out the
    experts (--ep 2). ms per layer of an F (a2a_F: the counts, the tokens out and back) and of a
    B (a2a_B: their gradients); the bytes an F stashes there (M_B) and an F's and a BW's whole
    time (F_op, BW_op), which sharing the experts out changes (the cost model takes the
    difference from the tp = 1 fits per layer: `ProfiledCostModel`); rank 0's step beyond its
    pipeline (tail_ms: the mean of its gradient sync, optimizer and the rest, where it waits for
    its partner) and its pipeline (pipeline_ms, median), from which the cost model takes the
    replicas' wait (`replica_skew`). The sizes take `turns` (no round judged busy by its wall
    over CPU time: these ops wait inside their exchanges), pooled: one run's exchanges wait on
    its partner's pace, and single runs put a step's in flight at 28 to 39 ms here."""
    m = 2
    schedule = build_schedule("1f1b", 1, m)
    specs = {mbs: probed.spec(mbs, layers, stages=1, schedule=schedule, dp=EP, ep=EP) for mbs in micro_batches}
    out: dict[int, ExpertExchange] = {}
    busy: list[list[float]] = []  # per size and rank, its time in ops each steady step
    op_variation: list[float] = []
    per_op = m * layers
    measured, _ = run_by_turns(specs, turns)
    for mbs in micro_batches:
        runs = measured[mbs]
        flags, kept_by_rank = steady_records(runs)
        tail, pipeline = step_tail(runs, flags)
        busy += speed_samples(kept_by_rank, op_variation)
        kept = [r for rounds_kept in kept_by_rank for records in rounds_kept for r in records]
        stash = [v for r in kept for v in stashed_bytes(r.entry_bytes)]
        lone = {
            kind: [1e3 * (end - start) for r in kept for text, start, end in r.ops if parse_op(text).kind is kind]
            for kind in (OpKind.F, OpKind.BW)
        }
        out[mbs] = ExpertExchange(
            F=statistics.median(r.a2a_forward_ms for r in kept) / per_op,
            B=statistics.median(r.a2a_ms - r.a2a_forward_ms for r in kept) / per_op,
            layers=layers,
            M_B=statistics.median(stash),  # an F's stash on this stage of `layers` layers, experts shared out
            F_op=statistics.median(lone[OpKind.F]),  # an F's and a BW's whole time on that stage, ms
            BW_op=statistics.median(lone[OpKind.BW]),
            tail_ms=tail,
            pipeline_ms=pipeline,
        )
    return LayoutProfile(speed=speed_of(busy, op_variation), exchange=out)
