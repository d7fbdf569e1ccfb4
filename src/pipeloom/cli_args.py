"""Arguments several commands share: which schedule, its costs, memory budget, split, checkpointing."""

from __future__ import annotations

import argparse

from pipeloom.costs import Costs
from pipeloom.errors import ConfigError
from pipeloom.passes.split_backward import W_PLACEMENTS

__all__ = ["add_ckpt", "add_costs", "add_mem_limit", "add_schedule_source", "add_tpipe_passes", "int_list"]


def add_schedule_source(parser: argparse.ArgumentParser, name_flag: str | None = None) -> None:
    """NAME (positional, or as `name_flag`), sizes, a schedule file instead, memory budget, split."""
    name_help = "schedule generator (see `pipeloom list`)"
    if name_flag:
        parser.add_argument(name_flag, dest="name", metavar="NAME", help=name_help)
    else:
        parser.add_argument("name", nargs="?", metavar="NAME", help=name_help)
    parser.add_argument("-p", "--devices", dest="p", type=int, help="number of devices")
    parser.add_argument("-m", "--microbatches", dest="m", type=int, help="micro-batches per step")
    parser.add_argument("-v", "--chunks", type=int, help="chunks (stages) per device, for interleaved, tpipe, svpp")
    parser.add_argument("--slices", type=int, help="slices per micro-batch along the sequence, for svpp and terapipe")
    parser.add_argument(
        "--forwards", type=int, metavar="F", help="svpp: forwards before the first backward (the memory/bubble variant)"
    )
    parser.add_argument(
        "--schedule-file",
        metavar="PATH",
        help="read a pipeloom.schedule/1 JSON file instead, or torch.distributed.pipelining's CSV (.csv)",
    )
    add_mem_limit(parser)
    parser.add_argument(
        "--split",
        choices=W_PLACEMENTS,
        help="split each fused backward BW into B and W, placing W right after its B, deferred to the end, "
        "or into idle gaps (fill)",
    )
    parser.add_argument(
        "--batch-w", action="store_true", help="with --split deferred|fill: keep each stage's deferred W contiguous"
    )


def add_costs(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--costs",
        metavar="SPEC|FILE",
        help="F=1,B=2,W=0,comm=0 (one device's share per micro-batch) or a JSON file with the Costs keys "
        "(F, B, W, R, comm, M_B, M_W, M_ckpt, M_static, and for --offload offload_bytes, reload_bytes, "
        "host_step_flops, M_offload, host_bandwidth, host_flops; scalars or per-stage lists)",
    )


def add_ckpt(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--ckpt",
        choices=("none", "full", "mario"),
        default="none",
        help="activation checkpointing: none; full (every forward, recompute inside its backward); mario "
        "(checkpoint where memory is short — everywhere without --mem-limit — and tessellate the recomputes "
        "into bubbles)",
    )
    parser.add_argument(
        "--passes",
        metavar="LIST",
        help="Mario's passes one by one, in this order, after --ckpt: apply-checkpoint, overlap-recompute, "
        "overlap-recompute-gaps, remove-redundancy, relax-checkpoint (within --mem-limit), prepose-forward",
    )


def add_mem_limit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mem-limit",
        metavar="BUDGET",
        help="activation memory per device for memory-driven schedules (zb-auto, v-auto), --ckpt mario and --exact: "
        "a number in the costs' "
        "memory unit (M_B = 1 unless costs say otherwise), a size like 40GiB when costs are in bytes, "
        "or one value per device separated by commas",
    )


def add_tpipe_passes(parser: argparse.ArgumentParser) -> None:
    """TPipe's T-Recomp and T-Offload, and MEPipe's weight-gradient parts."""
    parser.add_argument(
        "--recompute",
        metavar="shallow|CHUNKS",
        help="T-Recomp: checkpoint these chunks of every device (0 = shallowest; 'shallow' = 0) and recompute "
        "each block-wise before its backward; for tpipe and interleaved schedules",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="T-Offload: move the deep stages' optimizer work to the host (costs: offload_bytes, reload_bytes, "
        "host_step_flops, M_offload, host_bandwidth, host_flops) and report the overlap with bubbles",
    )
    parser.add_argument(
        "--offload-stages",
        metavar="LIST",
        help="with --offload: stages to offload (default: all but each device's shallowest)",
    )
    parser.add_argument(
        "--reload-bits", type=int, default=16, metavar="N", help="with --offload: bits per reloaded weight (default 16)"
    )
    parser.add_argument(
        "--weight-parts",
        type=int,
        metavar="K",
        help="cut every W into K parts (one per weight matrix) and run each where its device would wait, "
        "deferring what memory allows (MEPipe §5); splits fused backwards first",
    )


def int_list(text: str, what: str) -> list[int]:
    """'0,2,3' → [0, 2, 3], or ConfigError naming `what`."""
    try:
        return [int(item) for item in text.split(",") if item.strip()]
    except ValueError:
        raise ConfigError(f"{what} must be comma-separated integers, got {text!r}") from None


def mem_limit_from_args(args: argparse.Namespace):
    """--mem-limit, refused in bytes when the costs are unit-less (inline or default)."""
    from pipeloom.budget import budget_from_flag

    costs = getattr(args, "costs", None)
    return budget_from_flag(getattr(args, "mem_limit", None), costs_in_bytes=bool(costs) and "=" not in costs)


def costs_from_args(args: argparse.Namespace) -> Costs:
    """--costs as inline keys or a file (default: Costs()), refused if it gives no work at all."""
    spec = args.costs
    if spec is None:
        return Costs()
    costs = Costs.parse(spec) if "=" in spec else Costs.load(spec)
    work = [costs.F, costs.B, costs.W]
    if all(value == 0 or (isinstance(value, tuple) and not any(_flat(value))) for value in work):
        raise ConfigError("--costs: F, B and W are all zero — a schedule with no work has no time to plan")
    return costs


def _flat(value) -> list[float]:
    return [x for entry in value for x in (entry if isinstance(entry, tuple) else (entry,))]
