"""`pipeloom export-plan PLAN --for torch|torchtitan|megatron --output DIR`: a tuned plan in the words of
an engine that runs it. For torch.distributed.pipelining: the compute-only CSV of the plan's
schedule (`_PipelineScheduleRuntime._load_csv`), checked against the placement torch's schedules
build stages in, and on the terminal that placement, each stage's layers and the micro-batches —
what a training script needs to build the stages the CSV names. For torchtitan: the same CSV and
a job config fragment that makes torchtitan build those stages. For Megatron-LM: its arguments
(`tune.engines`), no CSV — it runs its own schedule on the plan's partition."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path

from pipeloom.cli.parser import add_command
from pipeloom.errors import ConfigError
from pipeloom.ir.torch_csv import placement_of, stage_ranks, to_torch_csv
from pipeloom.tune.engines import megatron_settings, torchtitan_settings

__all__ = ["register"]

ENGINES = ("torch", "torchtitan", "megatron")
CSV_NAME = "schedule.csv"
TORCHTITAN_NAME = "torchtitan.toml"
MEGATRON_NAME = "megatron-args.txt"


def register(commands) -> None:
    parser = add_command(
        commands,
        "export-plan",
        "write a tuned plan for the engine that runs it: torch's pipeline CSV, torchtitan's config, Megatron-LM's arguments",
        [
            "pipeloom export-plan plan.json --for torch --output torch-plan",
            "pipeloom export-plan plan.json --for torchtitan --output titan   # + torchtitan.toml to merge",
            "pipeloom export-plan plan.json --for megatron --output mlm       # megatron-args.txt",
        ],
    )
    parser.add_argument("plan", metavar="PLAN", help="a plan written by `pipeloom tune --output`")
    parser.add_argument(
        "--for",
        dest="engine",
        required=True,
        choices=ENGINES,
        help="the engine that runs it (torch: torch's own pipeline runtime; torchtitan: its job config too; "
        "megatron: Megatron-LM's arguments)",
    )
    parser.add_argument(
        "--output",
        "-o",
        required=True,
        metavar="DIR",
        help=f"the directory to write {CSV_NAME}, {TORCHTITAN_NAME} or {MEGATRON_NAME} in",
    )
    parser.add_argument("--force", action="store_true", help="replace what an earlier export wrote in DIR")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pipeloom.tune.plan import Plan

    plan = Plan.load(args.plan)
    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export-plan: --output {args.output!r} is a file, not a directory")
    if args.engine == "megatron":
        return _megatron(plan, out / MEGATRON_NAME, args.force)
    target, fragment = out / CSV_NAME, out / TORCHTITAN_NAME
    for path in (target, fragment) if args.engine == "torchtitan" else (target,):
        if path.exists() and not args.force:
            raise ConfigError(f"export-plan: {str(path)!r} exists; choose another --output or add --force")
    schedule = plan.schedule
    try:
        text = to_torch_csv(schedule)
        placement = placement_of(schedule)  # the one its stages sit in, or refused
    except ConfigError as error:
        raise ConfigError(f"export-plan: {error.summary}{_instead(plan)}") from None
    settings = torchtitan_settings(plan) if args.engine == "torchtitan" else None
    out.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    if settings is not None:
        fragment.write_text(settings.to_toml(str(target.resolve())))
    ranks = stage_ranks(schedule.num_devices, schedule.num_stages, placement)
    print(f"wrote {target}: {schedule.name} on {schedule.num_devices} pipeline ranks, the {placement} placement")
    for stage, (rank, layers) in enumerate(zip(ranks, plan.partition)):
        ends = ["embedding"] * (stage == 0) + ["head and loss"] * (stage == schedule.num_stages - 1)
        extra = f" + {' + '.join(ends)}" if ends else ""
        print(f"  stage {stage} on rank {rank}: {layers} layer{'s' * (layers != 1)}{extra}")
    print(
        f"  {schedule.num_microbatches} micro-batches of {plan.micro_batch_size} sample"
        f"{'s' * (plan.micro_batch_size != 1)} a step per pipeline "
        f"(n_microbatches={schedule.num_microbatches}); dp {plan.dp} and tp {plan.tp} are outside the CSV"
    )
    if settings is not None:
        print(
            f"wrote {fragment}: torchtitan's [parallelism] and [training] for it "
            f"(pipeline_parallel_schedule = {settings.pipeline_parallel_schedule!r}: the {placement} placement)"
        )
        if settings.left_out:
            print(f"  not done by torchtitan: {'; '.join(settings.left_out)}")
    return 0


def _megatron(plan, target: Path, force: bool) -> int:
    if target.exists() and not force:
        raise ConfigError(f"export-plan: {str(target)!r} exists; choose another --output or add --force")
    try:
        settings = megatron_settings(plan)
    except ConfigError as error:
        raise ConfigError(f"export-plan: {error.summary}") from None
    line = shlex.join(settings.arguments)
    target.parent.mkdir(parents=True, exist_ok=True)
    notes = "".join(f"# not done by Megatron-LM: {note}\n" for note in settings.left_out)
    target.write_text(f"# Megatron-LM arguments written by `pipeloom export-plan --for megatron`\n{notes}{line}\n")
    print(f"wrote {target}: {line}")
    if settings.left_out:
        print(f"  not done by Megatron-LM: {'; '.join(settings.left_out)}")
    return 0


def _instead(plan) -> str:
    """How to tune a plan without the memory passes torch's CSV has no action for (the CSV's own
    refusal names the scheme to export instead of one it cannot express). W parts are svpp's own
    pass, which no flag leaves out: its refusal names the scheme."""
    memory = [name for name in plan.passes if name != "wparts"]
    if memory:
        return f" (its memory passes {', '.join(memory)} have no torch action: tune --no-memory-passes)"
    return ""
