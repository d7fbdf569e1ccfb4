"""Probing a run's stages once: what crosses each boundary and the FLOPs of each forward.

The answer is the same on every rank (every rank builds the same model, on the meta device
where the workload can), so a launcher that starts several ranks probes once and hands the result to all (`run_local`,
`run_in_process`); a rank started alone (torchrun) probes for itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from pipeloom.ir.schedule import Schedule
from pipeloom.models.workload import Workload, rows_of
from pipeloom.runtime.boundary import StageProbe, probe_stages
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.spec import TrainSpec
from pipeloom.runtime.stage_call import run_stage

__all__ = ["check_probe_fits", "probe_boundaries", "probe_spec"]


def probe_spec(spec: TrainSpec) -> StageProbe:
    """The boundaries and FLOPs of `spec`'s stages, from a model built for the purpose (on the
    meta device when the workload can)."""
    work, stages, precision = spec.resolved_workload(), spec.schedule.num_stages, Precision(spec.dtype)
    if work.skeleton is None:
        return probe_boundaries(spec.schedule, work, work.build(stages), precision)
    skeleton = work.skeleton(stages)  # this one's own: made real in place if the probe needs real weights
    return probe_boundaries(spec.schedule, work, skeleton.stages, precision, rebuild=skeleton.whole)


def check_probe_fits(spec: TrainSpec, probe: StageProbe) -> None:
    """Refuse, before any rank starts, a micro-batch whose activations this host cannot hold
    (ranks on one machine share its memory; a GPU run's activations live on its GPUs)."""
    from pipeloom.models.memory_guard import check_stash_fits

    if spec.torch_device_type != "cpu" or not probe.stash_bytes:
        return
    work = spec.resolved_workload()
    stash = sum(probe.stash_bytes) * spec.schedule.num_slices  # the probe ran one slice
    check_stash_fits(stash, work.microbatch_size, work.sample_tokens, spec.dp)


def probe_boundaries(
    schedule: Schedule, work: Workload, all_stages, precision: Precision, rebuild: Callable[[], Sequence] | None = None
) -> StageProbe:
    """Boundary shapes and forward FLOPs from one micro-batch of step 0 (a slice, with slices).
    `rebuild`: real stages, where a real pass is needed; by default the workload builds them anew
    (a rank's own stages are cut later, and must stay on the meta device)."""
    inputs, _ = work.batch(work.microbatch_size, 0)
    example = rows_of(inputs, slice(0, work.microbatch_size))
    slices = schedule.num_slices
    if slices > 1:
        example = tuple(t[:, : t.shape[1] // slices] for t in example)
    past: list | None = [] if slices > 1 else None
    cpu = torch.device("cpu")
    return probe_stages(
        all_stages,
        example,
        lambda module, x: run_stage(module, x, past, precision, cpu, True)[0],
        rebuild=rebuild or (lambda: work.build(schedule.num_stages)),
    )
