"""Arguments several commands share: which schedule, its costs, memory budget, split, checkpointing."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeloom.costs import Costs, CostsFor
from pipeloom.errors import ConfigError
from pipeloom.ir.io import load_schedule
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.torch_csv import from_torch_csv
from pipeloom.passes.split_backward import W_PLACEMENTS, split_backward
from pipeloom.schedules import build_schedule, get_generator, list_generators

__all__ = [
    "add_ckpt",
    "add_costs",
    "add_mem_limit",
    "add_schedule_name",
    "add_schedule_source",
    "add_tpipe_passes",
    "costs_from_args",
    "costs_source",
    "generator_options",
    "int_list",
    "mem_limit_from_args",
    "schedule_from_args",
    "schedule_name",
]


def add_schedule_name(parser: argparse.ArgumentParser, many: bool = False) -> None:
    """The schedule's name, spelt the same in every command: positional, or `--schedule`."""
    what = "schedule generators" if many else "schedule generator"
    parser.add_argument(
        "name",
        nargs="*" if many else "?",
        metavar="NAME",
        help=f"{what} (see `pipeloom list`); or --schedule",
    )
    parser.add_argument(
        "--schedule",
        dest="schedule_flag",
        metavar="NAME" + (",NAME..." if many else ""),
        help=f"the {what}, as a flag" + (" (comma-separated)" if many else ""),
    )


def schedule_name(args: argparse.Namespace):
    """NAME or --schedule NAME (a list of names for `compare`), refused when both disagree."""
    positional, flag = args.name, args.schedule_flag
    if isinstance(positional, list):  # compare: several
        named = [name for name in (flag or "").split(",") if name]
        if positional and named:
            raise ConfigError("name the schedules once: as arguments or with --schedule, not both")
        return positional or named
    if positional and flag and positional != flag:
        raise ConfigError(f"two schedule names, {positional!r} and --schedule {flag!r}: give one")
    return positional or flag


def add_schedule_source(parser: argparse.ArgumentParser) -> None:
    """NAME (or --schedule NAME), sizes, a schedule file instead, memory budget, split."""
    add_schedule_name(parser)
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


def parse_bandwidth(text: str, what: str) -> float:
    """'450GB/s', '400Gb/s', '0.9TB/s' or a bare number of GB/s → bytes per second, or
    ConfigError naming `what`."""
    units = {"tb/s": 1e12, "gb/s": 1e9, "mb/s": 1e6}
    lowered = text.strip().lower()
    scale = 1e9
    for unit, factor in units.items():
        if lowered.endswith(unit):
            scale = factor / (8 if text.strip()[-3] == "b" else 1)  # Gb/s: bits
            lowered = lowered.removesuffix(unit)
            break
    try:
        value = float(lowered) * scale
    except ValueError:
        raise ConfigError(f"{what} must be a bandwidth such as 450GB/s, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{what} must be a positive bandwidth such as 450GB/s, got {text!r}")
    return value


def mem_limit_from_args(args: argparse.Namespace):
    """--mem-limit; a size in bytes only for costs in bytes (a file, or memory_unit=bytes)."""
    from pipeloom.budget import budget_from_flag

    costs: str | None = getattr(args, "costs", None)
    in_bytes = bool(costs) and costs is not None and ("=" not in costs or Costs.parse(costs).memory_unit == "bytes")
    return budget_from_flag(getattr(args, "mem_limit", None), costs_in_bytes=in_bytes)


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


def costs_source(args: argparse.Namespace) -> Costs | CostsFor:
    """What --costs gives: Costs (inline keys or a file of them, `costs_from_args`), or, from a
    profile file (`pipeloom profile`), its costs for each schedule's shape (`costs.priced`): the
    model's layers split evenly over the stages, at the profile's smallest micro-batch size, a
    device a rank (the file's plain Costs keys price two stages only)."""
    spec = getattr(args, "costs", None)
    if spec and "=" not in spec:
        from pipeloom.files import read_json

        data = read_json(spec, "costs", ConfigError)
        if isinstance(data, dict) and str(data.get("format", "")).startswith("pipeloom.profile/"):
            from pipeloom.tune.profiled import ProfiledCostModel

            return _stage_pricer(ProfiledCostModel(data))
    return costs_from_args(args)


def _stage_pricer(source) -> CostsFor:
    """(stages, slices) → the profiled cost model `source`'s costs for a schedule of that shape."""

    def price(stages: int, slices: int) -> Costs:
        layers = source.model.layers
        if layers < stages:
            raise ConfigError(f"--costs: the profiled model's {layers} layers cannot fill {stages} stages")
        counts = [layers // stages + (stage < layers % stages) for stage in range(stages)]
        return source.stage_costs(counts, source.sizes[0], stages, 1, slices=slices)

    return price


def _flat(value) -> list[float]:
    return [x for entry in value for x in (entry if isinstance(entry, tuple) else (entry,))]


def schedule_from_args(args: argparse.Namespace, costs: Costs, budget_is_used: bool = False) -> Schedule:
    """The named (or loaded) schedule, with --split applied; generators that take costs get them."""
    if args.batch_w and args.split not in ("deferred", "fill"):
        raise ConfigError("--batch-w needs --split deferred or --split fill")
    budget = mem_limit_from_args(args)
    name = schedule_name(args)
    if args.schedule_file:
        if name or args.p is not None or args.m is not None or _generator_flags(args):
            raise ConfigError(
                "give either a schedule NAME with -p/-m[/-v/--slices/--forwards] or --schedule-file, not both"
            )
        if budget is not None and not budget_is_used:
            raise ConfigError(
                "--mem-limit applies to memory-aware generators (zb-auto, v-auto), --ckpt mario or --exact"
            )
        schedule = _load_schedule_file(args.schedule_file)
    else:
        if not name:
            raise ConfigError("name a schedule (see `pipeloom list`) or give --schedule-file")
        options = generator_options(name)  # an unknown name, before the sizes it would need
        if args.p is None or args.m is None:
            raise ConfigError(f"schedule {name!r} needs -p (devices) and -m (micro-batches)")
        kwargs: dict = _generator_flags(args)
        for flag, option in (("-v", "num_chunks"), ("--slices", "num_slices"), ("--forwards", "forwards")):
            if option in kwargs and option not in options:
                raise ConfigError(f"schedule {name!r} does not take {flag}")
        if "costs" in options:
            kwargs["costs"] = costs
        if budget is not None and "mem_limit" in options:
            kwargs["mem_limit"] = budget
        elif budget is not None and not budget_is_used:
            takers = ", ".join(g.name for g in list_generators() if "mem_limit" in g.options)
            raise ConfigError(f"schedule {name!r} takes no memory limit; memory-driven schedules: {takers}")
        from pipeloom.cli.output import still_working

        with still_working(f"building {name} for p={args.p}, m={args.m}", getattr(args, "quiet", False)):
            schedule = build_schedule(name, args.p, args.m, **kwargs)
    if args.split:
        schedule = split_backward(schedule, args.split, costs=costs, batch=args.batch_w)
    return schedule


def generator_options(name: str, instead: str = "pass --schedule-file {name}"):
    """The options of the generator `name`; ConfigError for an unknown one, saying what to do
    `instead` where it is a file (a plan or a schedule written by `tune` or `simulate --export`)."""
    if name not in {info.name for info in list_generators()} and Path(name).is_file():
        raise ConfigError(f"{name!r} is a file, not a schedule's name: {instead.format(name=name)}")
    return get_generator(name).options


def _load_schedule_file(path: str) -> Schedule:
    """A pipeloom.schedule/1 JSON file, or torch.distributed.pipelining's CSV (.csv), validated."""
    if not path.endswith(".csv"):
        return load_schedule(path).validate()
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read schedule file {path!r}: {error.strerror}") from None
    return from_torch_csv(text, name=Path(path).stem)


def _generator_flags(args: argparse.Namespace) -> dict:
    """The generator options given on the command line (-v, --slices, --forwards)."""
    given = {"num_chunks": args.chunks, "num_slices": args.slices, "forwards": args.forwards}
    return {option: value for option, value in given.items() if value is not None}
