"""Checkpoint and resume with torch.distributed.checkpoint: model, optimizer, data position, RNG,
the learning-rate curve.

A checkpoint of the state after n steps is the directory ``DIR/step-n``. Every rank writes its
stages' parameters and AdamW state keyed by each parameter's name in the whole model
(`models.workload.global_names`), so data-parallel and Chimera copies of a stage are one entry,
split linears read what plain ones wrote, and a checkpoint resumes under another schedule or
pipeline size: DCP reads each name wherever it now lives. Under ZeRO each replica writes its own
shard of the fp32 master weights and moments, keyed by device and shard, and the host's offloaded
optimizer by stage — what a resume on the same layout reads — and both also write every weight's
fp32 master and moments by name (`master.NAME`, `optim.NAME.*`, ZeRO's gathered over the
replicas), which any other layout, ZeRO level or offload set resumes from (`_by_name`) and
`export` writes. Under tensor or expert parallelism each cut weight and its optimizer state go in
as a DTensor of this rank's shard, which DCP saves as shards of one tensor — the whole weight
under its name, so a resume under another tp or ep (or none) reads its own slices, unless the
model packs several projections into one weight. The step and its RNG state go into
``DIR/step-n.partial``; after a barrier rank 0 writes ``model.json`` (what the model is, for
`pipeloom export`), renames it to ``DIR/step-n`` and only then writes the ``COMPLETE`` marker
(JSON: step, world size, schedule, layout facts, the learning-rate curve, the run's
configuration). A crash at any point leaves either a ``.partial`` directory, ignored, or a
directory without its marker — a torn checkpoint, which resuming refuses — and never touches an
earlier complete checkpoint. The data of step n depends only on the seed and n, so the step is the
data position.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.runtime.lr_schedule import LRCurve

__all__ = ["after_save", "find_checkpoint", "read_checkpoint", "save_checkpoint", "load_checkpoint", "MODEL"]

_STEP = re.compile(r"^step-(\d+)$")
MARKER = "COMPLETE"
MODEL = "model.json"


def find_checkpoint(
    path: str | os.PathLike[str],
    world_size: int,
    schedule: str,
    zero: int = 0,
    offload_stages=(),
    tp: int = 1,
    layout_free: bool = False,
    tp_packed: bool = False,
) -> tuple[Path, dict]:
    """(directory, the facts of its marker — ``step`` is the steps done) of the checkpoint at `path` — a ``step-n`` directory, or the newest
    one inside `path` — or ConfigError if it is missing, torn, or from another run's shape. A
    checkpoint whose weights are keyed by their names in the whole model (`layout_free`, on both
    sides) and whose optimizer state is by name too (`optimizer_by_name`: ZeRO and the host's
    save theirs so as well) resumes under any schedule, pipeline, data-parallel, tensor- or
    expert-parallel size, ZeRO level or offload set — but across tp only for a model without
    packed projections (`tp_packed`). Older checkpoints move only with whole optimizer state."""
    chosen, facts = read_checkpoint(path)
    saved_tp = facts.get("tp", 1)
    if saved_tp != tp and (tp_packed or facts.get("tp_packed", saved_tp > 1)):  # older ones: assume so
        raise ConfigError(
            f"checkpoint {str(chosen)!r} holds weights cut over tp = {saved_tp} ranks, not {tp}, and the model packs "
            f"several projections in one weight (GPT-2's q, k, v), whose shards are not slices of the whole: resume "
            f"with --tp {saved_tp}"
        )
    if layout_free and facts.get("layout_free", False) and facts.get("optimizer_by_name", False):
        return chosen, facts  # every weight and optimizer state by name: any layout reads it
    fixed = "its optimizer state is sharded by rank (ZeRO or host offload)"
    if not (layout_free and facts.get("layout_free", False)):
        fixed = "its weights are keyed by stage, not by their names in the model"
    if saved_tp != tp and (zero or offload_stages or not (layout_free and facts.get("layout_free", False))):
        raise ConfigError(
            f"checkpoint {str(chosen)!r} holds weights cut over tp = {saved_tp} ranks, not {tp}, and {fixed}: "
            f"resume with --tp {saved_tp}"
        )
    if facts.get("zero", 0) != zero:
        raise ConfigError(
            f"checkpoint {str(chosen)!r} holds ZeRO-{facts.get('zero', 0)} optimizer state, not ZeRO-{zero}: "
            f"resume with --zero {facts.get('zero', 0)}"
        )
    if sorted(facts.get("offload_stages", [])) != sorted(offload_stages):
        raise ConfigError(
            f"checkpoint {str(chosen)!r} has the optimizer of stages {sorted(facts.get('offload_stages', []))} on the "
            f"host, not {sorted(offload_stages)}: resume with the same --offload-stages"
        )
    if facts.get("world_size") != world_size or facts.get("schedule") != schedule:
        movable = layout_free and facts.get("layout_free", False) and zero == 0 and not offload_stages
        if not movable:
            raise ConfigError(
                f"checkpoint {str(chosen)!r} was written by {facts.get('world_size')} ranks running "
                f"{facts.get('schedule')!r}, not {world_size} ranks running {schedule!r}, and {fixed}"
            )
    return chosen, facts


def read_checkpoint(path: str | os.PathLike[str]) -> tuple[Path, dict]:
    """(directory, the facts of its ``COMPLETE`` marker) of the checkpoint at `path` (a ``step-n``
    directory or the newest inside `path`); ConfigError if it is missing or torn."""
    path = Path(path)
    if _STEP.match(path.name):
        chosen = path
    else:
        found = sorted(
            (int(m.group(1)), p) for p in (path.iterdir() if path.is_dir() else []) if (m := _STEP.match(p.name))
        )
        if not found:
            raise ConfigError(f"no checkpoint in {str(path)!r} (expected step-N directories written by --save)")
        chosen = found[-1][1]
    marker = chosen / MARKER
    if not chosen.is_dir():
        raise ConfigError(f"checkpoint {str(chosen)!r} does not exist")
    if not marker.is_file() or not (chosen / ".metadata").is_file():
        raise ConfigError(f"checkpoint {str(chosen)!r} is torn (no {MARKER} marker or metadata): it was not finished")
    try:
        facts = json.loads(marker.read_text())
        int(facts["step"])
        LRCurve.from_record(facts.get("lr_curve"))
    except (ValueError, KeyError, TypeError, ConfigError):
        raise ConfigError(f"checkpoint {str(chosen)!r} has an unreadable {MARKER} marker") from None
    return chosen, facts


def _state(
    stages: dict[int, nn.Module],
    holders,
    shards: Callable | None = None,
    names: dict[int, dict[str, str]] | None = None,
    masters: bool = False,
    by_name: bool = False,
) -> dict:
    """Tensors to save or to load into, in place: each parameter (by its name in the whole model,
    `names`, or else by stage and name) and the optimizers' state (`pipeloom.runtime.zero`, and
    the host's for offloaded stages; with `masters`, a save, also the fp32 masters they keep
    apart, by name; with `by_name`, a load of another layout's checkpoint, the optimizers' state
    by name only). `shards` (parameter, tensor) → the tensor as a DTensor of this rank's
    shard, for a cut parameter."""
    state: dict = {}
    keys: dict[int, str] = {}
    by_key: dict[str, nn.Parameter] = {}
    for stage, module in stages.items():
        for name, parameter in module.named_parameters():
            key = names[stage][name] if names is not None else f"stage{stage}.{name}"
            state[f"model.{key}"] = parameter.data
            keys.setdefault(id(parameter), key)
            by_key[key] = parameter
    for holder in holders:
        state.update(holder.checkpoint_state(keys, masters, by_name))
    if shards is not None:
        for entry, value in state.items():
            kind, _, rest = entry.partition(".")
            if kind == "host":  # host.stageS.NAME.field
                rest = rest.partition(".")[2]
            key = rest if kind in ("model", "master") else rest.rpartition(".")[0]
            owner = by_key.get(key) if kind in ("model", "optim", "host", "master") else None
            if owner is not None and isinstance(value, torch.Tensor) and value.shape == owner.shape:
                state[entry] = shards(owner, value)
    return state


def save_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    stages: dict[int, nn.Module],
    holders,
    facts: dict,
    shards: Callable | None = None,
    names: dict[int, dict[str, str]] | None = None,
    model: dict | None = None,
) -> Path:
    """Collective: every rank calls it after the same step. `holders` own the optimizer state;
    `facts` (JSON: schedule, zero, offload_stages, tp, layout_free, the learning-rate curve,
    the run's configuration) go into the marker beside the step and world size; `model`
    (the workload's description) into ``model.json``, for `pipeloom export`."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final = Path(directory) / f"step-{step}"
    partial = Path(directory) / f"step-{step}.partial"
    if rank == 0:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
    dist.barrier()
    state = _state(stages, holders, shards, names, masters=True)
    state[f"rng.rank{rank}"] = torch.get_rng_state()
    state["step"] = torch.tensor(step)
    dcp.save(state, checkpoint_id=partial)
    dist.barrier()
    if rank == 0:
        if model is not None:
            (partial / MODEL).write_text(json.dumps(model, default=str))
        shutil.rmtree(final, ignore_errors=True)  # a torn one left by a crash: never a complete one
        partial.rename(final)
        (final / MARKER).write_text(json.dumps({"step": step, "world_size": world, **facts}, default=str))
    dist.barrier()
    return final


def load_checkpoint(
    path: Path,
    stages: dict[int, nn.Module],
    holders,
    shards: Callable | None = None,
    names: dict[int, dict[str, str]] | None = None,
    whole_names: frozenset[str] = frozenset(),
) -> int:
    """Restore this rank's stages, optimizers and RNG in place; return the steps done. A rank
    the checkpoint did not have (another layout) keeps its RNG: the data depends on the step only.
    With `names` (by name), `whole_names` — every weight of the whole model — is checked to hold
    every weight the checkpoint does."""
    rank = dist.get_rank()
    stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    state = _state(stages, holders, shards, names)
    if any(
        key.startswith(("zero.", "host.")) and not _stored_alike(key, value, stored) for key, value in state.items()
    ):
        state = _by_name(_state(stages, holders, shards, names, by_name=True), stored)  # another layout wrote it
    elif any(key.startswith("master.") for key in stored) and not any(k.startswith(("zero.", "host.")) for k in state):
        state = _by_name(state, stored)  # fp32 weights from the masters a ZeRO or offloaded run kept apart
    rng = f"rng.rank{rank}"
    if names is not None and whole_names:  # keyed by name: each rank checks the whole model's
        _check_nothing_dropped(path, whole_names, stored)
    _check_same_model(path, state, stored)
    if rng in stored:
        state[rng] = torch.get_rng_state()
    state["step"] = torch.tensor(0)
    with torch.no_grad():
        dcp.load(state, checkpoint_id=path)  # in place: into the parameters and optimizer state
    if rng in state:
        torch.set_rng_state(state[rng])
    for holder in holders:
        holder.after_load()
    return int(state["step"])


def _stored_alike(key: str, value, stored: dict) -> bool:
    """Whether the checkpoint holds `key` in `value`'s shape (a layout's shard: the same layout)."""
    entry = stored.get(key)
    if entry is None:
        return False
    size = getattr(entry, "size", None)
    return size is None or tuple(size) == tuple(value.shape)


def _by_name(state: dict, stored: dict) -> dict:
    """`state` to load from a checkpoint by name: a weight from its fp32 master where the run that
    wrote it kept one (`master.NAME`), else from the weight itself — a master wanted where there
    is none reads the weight (the run kept its masters in its weights)."""
    out: dict = {}
    for key, value in state.items():
        kind, _, name = key.partition(".")
        if kind == "model" and f"master.{name}" in stored:
            if f"master.{name}" not in state:
                out[f"master.{name}"] = value
            continue
        if kind == "master" and key not in stored:
            out[f"model.{name}"] = value
            continue
        out[key] = value
    return out


def _check_same_model(path: Path, state: dict, stored: dict) -> None:
    """ConfigError naming the checkpoint and the first weight at fault when this run's model is
    not the one it holds (another size, layer count or family): DCP's own error names neither."""
    faults = []
    for key, value in state.items():
        if not key.startswith("model."):
            continue
        saved = stored.get(key)
        if saved is None:
            faults.append(f"it holds no {key[6:]}")
        elif tuple(getattr(saved, "size", ())) != tuple(value.shape):
            faults.append(f"its {key[6:]} is {list(saved.size)}, this run's {list(value.shape)}")
    if faults:
        more = f" (and {len(faults) - 1} more)" if len(faults) > 1 else ""
        raise ConfigError(
            f"checkpoint {str(path)!r} holds another model: {faults[0]}{more}; resume with the model and flags it "
            f"was trained with (its {MODEL} and COMPLETE marker say what they were)"
        )


def _check_nothing_dropped(path: Path, whole: frozenset[str], stored: dict) -> None:
    """ConfigError when the checkpoint holds a trained weight this run's model has no place for:
    an untied head resumed into a model that ties it to its embeddings was dropped, and the run
    said "resumed"."""
    extra = sorted(key[6:] for key in stored if key.startswith("model.") and key[6:] not in whole)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ConfigError(
            f"checkpoint {str(path)!r} holds {extra[0]}{more}, which this run's model has no place for (a head "
            f"the model ties to its embeddings?); resume with the model it was trained with"
        )


def after_save(saved: Path, keep_last: int, report: bool) -> None:
    """Rank 0, once a checkpoint is complete: drop the complete ones older than the newest
    `keep_last` (0: keep every one; a long run with a short period otherwise fills the disk),
    and say so in one line."""
    steps = sorted(
        (int(match.group(1)), entry)
        for entry in saved.parent.iterdir()
        if (match := _STEP.match(entry.name)) and (entry / MARKER).exists()
    )
    dropped = [entry for _, entry in steps[:-keep_last]] if keep_last else []
    for entry in dropped:
        shutil.rmtree(entry, ignore_errors=True)
    if report:
        pruned = f", removed {', '.join(entry.name for entry in dropped)} (--keep-last {keep_last})" if dropped else ""
        print(f"saved checkpoint {saved}{pruned}", flush=True)
