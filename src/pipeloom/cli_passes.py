"""How `simulate`'s (and `train`'s) pass flags become passes: --ckpt, --recompute, --weight-parts, --offload."""

from __future__ import annotations

import argparse

from pipeloom.cli_args import int_list, mem_limit_from_args
from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule
from pipeloom.passes.checkpoint import apply_checkpoint
from pipeloom.passes.mario import mario
from pipeloom.passes.offload import OffloadTimeline, simulate_offload, t_offload
from pipeloom.passes.trecomp import t_recomp
from pipeloom.passes.weight_parts import weight_parts

__all__ = ["checkpointed", "offloaded", "with_passes"]


def with_passes(schedule: Schedule, costs: Costs, args: argparse.Namespace) -> Schedule:
    """`schedule` after --ckpt, --recompute and --weight-parts, in that order."""
    schedule = _recomputed(checkpointed(schedule, costs, args), args)
    if args.weight_parts is not None:
        schedule = weight_parts(schedule, costs, args.weight_parts, mem_limit=mem_limit_from_args(args))
    return schedule


def checkpointed(schedule: Schedule, costs: Costs, args: argparse.Namespace) -> Schedule:
    """`schedule` with the checkpointing --ckpt asks for."""
    if args.ckpt == "full":
        return apply_checkpoint(schedule)
    if args.ckpt == "mario":
        return mario(schedule, costs, mem_limit_from_args(args))
    return schedule


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
