"""A rank's side of checkpoints: what its marker records about the run (layout, schedule, the
learning rate's curve, and the data and compute type it trained on, so a resume can refuse
other inputs), and restoring a rank from one."""

from __future__ import annotations

from pipeloom.models.workload import layout_free
from pipeloom.runtime.checkpoint import after_save, find_checkpoint, load_checkpoint, save_checkpoint
from pipeloom.runtime.lr_schedule import LRCurve, resumed_curve
from pipeloom.runtime.spec_checks import input_changes
from pipeloom.runtime.tensor_parallel_styles import packs_projections

__all__ = ["save_rank", "resume_rank"]


def save_rank(run, directory: str, steps_done: int) -> None:
    """Collective: every rank of `run` (a `RankRun`) writes its part of ``directory/step-n``."""
    if run.optimizer.host is not None:
        run.optimizer.host.settle()  # its learning-rate step too
    spec, parallel = run.spec, run.spec.parallelism
    facts = {
        "schedule": parallel.schedule.name,
        "zero": parallel.zero,
        "offload_stages": sorted(parallel.offload_stages),
        "tp": parallel.tp,
        "tp_packed": packs_projections(run.model.work, run.spec.parallelism.tp, run.spec.parallelism.sequence_parallel),
        "ep": parallel.ep,
        "layout_free": layout_free(list(run.model.names.values())),
        "optimizer_by_name": True,  # every holder writes its state by weight name too
        "lr_curve": run.optimizer.learning.curve.record(),
        "config": spec.run_config,
        "data": run.model.work.data,
        "dtype": spec.dtype,
    }
    shards = run.model.placements.as_dtensor
    saved = save_checkpoint(
        directory,
        steps_done,
        run.model.stages,
        run.optimizer.holders,
        facts,
        shards,
        run.model.names,
        run.model.work.description,
    )
    if run.rank == 0:
        after_save(saved, spec.checkpoints.keep_last, spec.report)


def resume_rank(run) -> None:
    """Restore `run`'s stages, optimizers, RNG and learning-rate schedule from the spec's
    checkpoint; rank 0 says where from, and what changed when `--allow-input-change` let it."""
    spec, parallel = run.spec, run.spec.parallelism
    found, facts = find_checkpoint(
        spec.checkpoints.resume_from,
        run.groups.transport.world_size,
        parallel.schedule.name,
        parallel.zero,
        parallel.offload_stages,
        parallel.tp,
        layout_free(list(run.model.names.values())),
        packs_projections(run.model.work, run.spec.parallelism.tp, run.spec.parallelism.sequence_parallel),
    )
    by_name = run.model.names if "layout_free" in facts else None  # older checkpoints: by stage
    shards = run.model.placements.as_dtensor
    run.first_step = load_checkpoint(
        found, run.model.stages, run.optimizer.holders, shards, by_name, run.model.whole_names
    )
    learning, recorded = run.optimizer.learning, LRCurve.from_record(facts.get("lr_curve"))
    if recorded is None:
        learning.load_state_dict(facts.get("lr_schedule"))
    else:
        if run.optimizer.host is not None:
            run.optimizer.host.settle()
        curve = resumed_curve(spec.optimizer.curve(spec.steps), recorded, run.first_step, spec.optimizer.lr_restart)
        learning.resume(curve, run.first_step)
    if spec.report and run.rank == 0:
        changes = input_changes(facts, run.model.work.data, spec.dtype)
        note = f"; it was trained on {'; and '.join(changes)}" if changes else ""
        print(f"resumed from {found}: {run.first_step} of {spec.steps} steps done{note}", flush=True)
        if recorded is not None and learning.curve != recorded:
            was, now = recorded.rate_at(run.first_step), learning.curve.rate_at(run.first_step)
            print(
                f"learning rate from step {run.first_step}: {learning.curve} (was {recorded}); "
                f"step {run.first_step} trains at {now:g} (was {was:g})",
                flush=True,
            )
