"""How `simulate`'s (and `train`'s) pass flags become passes: --ckpt, --recompute, --weight-parts, --offload."""

from __future__ import annotations

import argparse

from pipeloom.cli.args import int_list, mem_limit_from_args
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.checkpoint import (
    apply_checkpoint,
    overlap_recompute,
    prepose_forward,
    relax_checkpoint,
    remove_redundancy,
)
from pipeloom.passes.mario import mario
from pipeloom.passes.offload import OffloadTimeline, simulate_offload, t_offload
from pipeloom.passes.trecomp import t_recomp
from pipeloom.passes.weight_parts import weight_parts

__all__ = ["MARIO_PASSES", "checkpointed", "offloaded", "passes_use_budget", "with_passes"]


def with_passes(schedule: Schedule, costs: Costs, args: argparse.Namespace) -> Schedule:
    """`schedule` after --ckpt, --recompute and --weight-parts, in that order."""
    schedule = _recomputed(checkpointed(schedule, costs, args), args)
    if args.weight_parts is not None:
        schedule = weight_parts(schedule, costs, args.weight_parts, mem_limit=mem_limit_from_args(args))
    return schedule


MARIO_PASSES = {
    "apply-checkpoint": lambda s, c, limit: apply_checkpoint(s),
    "overlap-recompute": lambda s, c, limit: overlap_recompute(s),
    "overlap-recompute-gaps": lambda s, c, limit: overlap_recompute(s, c, into_gaps=True),
    "remove-redundancy": lambda s, c, limit: remove_redundancy(s),
    "relax-checkpoint": lambda s, c, limit: relax_checkpoint(s, c, limit),
    "prepose-forward": lambda s, c, limit: prepose_forward(s, c),
}
"""Mario's passes by their command-line names (`pipeloom.passes.checkpoint`)."""


def checkpointed(schedule: Schedule, costs: Costs, args: argparse.Namespace) -> Schedule:
    """`schedule` with the checkpointing --ckpt asks for, then each of --passes in turn."""
    if args.ckpt == "full":
        schedule = apply_checkpoint(schedule)
    elif args.ckpt == "mario":
        schedule = mario(schedule, costs, mem_limit_from_args(args))
    names = _pass_names(getattr(args, "passes", None))
    limit = mem_limit_from_args(args) if names else None
    for name in names:
        schedule = MARIO_PASSES[name](schedule, costs, limit)
    return schedule


def passes_use_budget(args: argparse.Namespace) -> bool:
    """Whether --ckpt or --passes take --mem-limit (Mario, relax-checkpoint)."""
    return args.ckpt == "mario" or "relax-checkpoint" in _pass_names(getattr(args, "passes", None))


def _pass_names(text: str | None) -> list[str]:
    names = [name.strip() for name in text.split(",")] if text else []
    unknown = [name for name in names if name not in MARIO_PASSES]
    if unknown:
        raise ConfigError(
            f"--passes: unknown pass {', '.join(map(repr, unknown))}; choose among {', '.join(MARIO_PASSES)}"
        )
    return names


def _recomputed(schedule: Schedule, args: argparse.Namespace) -> Schedule:
    """`schedule` with the T-Recomp --recompute asks for."""
    if args.recompute is None:
        return schedule
    if args.ckpt != "none":
        raise ConfigError("--recompute (T-Recomp) chooses its own checkpointing; it cannot be combined with --ckpt")
    chunks = [0] if args.recompute == "shallow" else int_list(args.recompute, "--recompute")
    return t_recomp(schedule, chunks)


def offloaded(schedule: Schedule, costs: Costs, args: argparse.Namespace) -> OffloadTimeline | None:
    """The T-Offload simulation --offload asks for, or None."""
    if not args.offload:
        if args.offload_stages is not None or args.reload_bits != 16:
            raise ConfigError("--offload-stages and --reload-bits apply to --offload")
        return None
    stages = int_list(args.offload_stages, "--offload-stages") if args.offload_stages is not None else None
    return simulate_offload(t_offload(schedule, stages, args.reload_bits), costs)
