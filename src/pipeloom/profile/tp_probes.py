"""Tensor-parallel op times, measured: a single stage on tp ranks, at each probe's shape.

The tp = 1 profile divided by tp, plus each collective timed alone (`links`), prices a tensor-
parallel op at what its arithmetic and bytes would cost. On this machine that was 2.5× too low:
a 4-layer stage of examples/hf-llama-tiny at micro-batch 2 ran its forward in 7.4 ms on one rank
and in 28.9 ms on each of two (36.3 ms with sequence parallelism), its ops at 1.9× their CPU
time. DTensor dispatches every op of the sharded modules in Python, and each collective waits
for the slower rank, whose jitter it then carries. Neither follows from the tp = 1 times, so a
profile asked for tensor parallelism measures it: the probe schedule (`probe_rounds.probe_schedule`)
on one stage of n layers over tp ranks, for each micro-batch size and n, fitted as time = a·n +
b per pass, and its stashed bytes the same way (`tune.profiled.ProfiledCostModel` prices a
stage at other positions by the tp = 1 intercepts scaled as the single stage's). The machine's
contention is judged on the tp = 1 probes: a tensor-parallel op's wall time is its CPU time plus
its waits by design. Those waits also make its time vary more from step to step, and skew it (a
wait is never negative): measured here, a tp = 2 plan's median step ran 1.6–5.8 % longer than its
median ops replayed, the tp = 1 plans' −0.1–3.7 %, most under 1 %. So each layout keeps its own
speed (`speed.speed_of`), which `tune.speed_noise` draws from for that layout's plans.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.errors import ConfigError
from pipeloom.profile.probe_rounds import ProbeModel, Turns, measure_probes
from pipeloom.profile.speed import speed_of
from pipeloom.profile_format import FIT_KINDS, Fit, Layout, LayoutProfile
from pipeloom.tune.profile_fits import fit_positions

__all__ = ["tensor_parallel_fits"]


def tensor_parallel_fits(
    layouts: Sequence[tuple[int, bool]],
    probed: ProbeModel,
    micro_batches: Sequence[int],
    layer_counts: Sequence[int],
    turns: Turns,
) -> dict[Layout, LayoutProfile]:
    """Each (tp, sequence parallel) of `layouts` measured on one stage over tp ranks, by `turns`
    (no round judged busy: these ops wait inside their collectives): per micro-batch size, each
    pass (ms) and stash (bytes: M_B, M_ckpt) fitted over the layers (the single stage's
    intercept), and the layout's speed. The workload must be a Hugging Face model's (their
    tensor-parallel plans are transformers')."""
    if not layouts:
        return {}
    if probed.workload_for is None:
        raise ConfigError("profile: tensor parallelism is measured on Hugging Face models (--model hf:DIR)")
    out = {}
    for tp, sequence_parallel in layouts:
        layout = Layout(tp, sequence_parallel)
        specs = {
            (mbs, n): probed.spec(mbs, n, stages=1, tp=tp, sequence_parallel=sequence_parallel)
            for mbs in micro_batches
            for n in layer_counts
        }
        op_variation: list[float] = []
        measured = measure_probes(specs, turns.of(layout), op_variation)
        fits = {
            mbs: {
                kind: Fit(**fit_positions([("single", n, measured[mbs, n].median(f"{kind}@0")) for n in layer_counts]))
                for kind in FIT_KINDS
                if f"{kind}@0" in measured[mbs, layer_counts[0]].values
            }
            for mbs in micro_batches
        }
        speed = speed_of((busy for probe in measured.values() for busy in probe.busy), op_variation)
        out[layout] = LayoutProfile(fits=fits, speed=speed, layers=tuple(sorted(set(layer_counts))))
    return out
