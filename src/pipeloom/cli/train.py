"""`pipeloom train`: run a schedule (or a plan) on local ranks; torch is imported only when a run
starts. The torchrun entry point `python -m pipeloom.train` shares the spec and outputs."""

from __future__ import annotations

import argparse
from dataclasses import replace
from functools import partial

from pipeloom.cli.args import costs_from_args, schedule_from_args
from pipeloom.cli.model import workload_from_args
from pipeloom.cli.parser import add_command
from pipeloom.cli.passes import checkpointed, passes_use_budget
from pipeloom.cli.train_args import add_train_arguments, check_train_flags, run_options
from pipeloom.errors import ConfigError

__all__ = ["register", "rank_spec", "train_spec_from_args", "write_train_outputs"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "train",
        "train a model with a schedule on local ranks (torch, gloo); or run a plan from `tune`",
        [
            "pipeloom train zb-v -p 2 -m 4 --nproc 2 --steps 3",
            "pipeloom train --nproc 4 --schedule zb-h1 -p 2 -m 4 --tp 2 --sequence-parallel "
            "--model hf:examples/hf-llama-tiny --seq-len 64",
            "pipeloom train --plan plan.json --steps 6",
        ],
    )
    parser.add_argument(
        "--nproc", type=int, help="ranks to start on this machine (= p × dp × tp; with --plan, the plan's)"
    )
    add_train_arguments(parser)
    parser.set_defaults(handler=run, train_parser=parser)


def run(args: argparse.Namespace) -> int:
    """Train locally with `--nproc` ranks: forked on CPU, spawned one per GPU with --device cuda
    (torch imported here only; CUDA only in the ranks)."""
    check_train_flags(args)
    spec = train_spec_from_args(args, report=not args.quiet)
    expected = spec.parallelism.layout.world_size
    if args.nproc is None and not args.plan:
        raise ConfigError("train needs --nproc (= p × dp × cp × tp ranks) or --plan")
    if args.nproc is not None and args.nproc != expected:
        grid, sizes = ("p × dp × cp × tp", (spec.dp, spec.cp)) if spec.cp > 1 else ("p × dp × tp", (spec.dp,))
        raise ConfigError(
            f"--nproc {args.nproc} does not match {grid} = "
            f"{' × '.join(map(str, (spec.schedule.num_devices, *sizes, spec.tp)))} = {expected}"
        )
    recipe = None
    if spec.torch_device_type == "cuda":  # one spawned process per GPU, each rebuilding the spec from the flags
        import torch

        gpus = torch.cuda.device_count()  # asks the driver; starts no CUDA context here
        if expected > gpus:
            raise ConfigError(
                f"--device cuda: {expected} ranks need {expected} GPUs, this machine has {gpus}; "
                f"on several machines: torchrun --nnodes N --nproc-per-node G -m pipeloom.train <same flags>"
            )
        recipe = partial(rank_spec, _flags_of(args), spec.run_config, spec.report)
    from pipeloom.cli.config_file import config_line
    from pipeloom.runtime.local import run_local
    from pipeloom.runtime.probe import check_probe_fits, probe_spec
    from pipeloom.runtime.report import data_line
    from pipeloom.runtime.run_outputs import spec_outputs

    probe = probe_spec(spec)
    check_probe_fits(spec, probe)  # before a line is printed: bad input gets one line
    with spec_outputs(spec):  # held from before the header: a refused run prints one line
        print(config_line(args, args.train_parser), flush=True)
        print(data_line(spec), flush=True)
        if shared := _shared_cores(spec):
            print(shared, flush=True)
        results = run_local(spec, probe=probe, recipe=recipe)  # its deadline: --timeout a step and an eval batch
    write_train_outputs(results, spec, args)
    if args.plan:
        from pipeloom.cli.plan import fidelity_report
        from pipeloom.tune.plan import Plan

        print(fidelity_report(Plan.load(args.plan), results))
    return 0


def _shared_cores(spec) -> str | None:
    """A line for CPU ranks whose threads outnumber this machine's cores: they share them, each op
    slower than on a core of its own (as `profile` measured, and `tune` priced)."""
    from pipeloom.tune.pool import default_jobs

    ranks, cores = spec.parallelism.layout.world_size, default_jobs()
    if spec.torch_device_type != "cpu" or ranks * spec.threads <= cores:
        return None
    return (
        f"ranks: {ranks} × {spec.threads} thread(s) on this machine's {cores} cores: they share them, each op up to "
        f"{ranks * spec.threads / cores:.3g}× slower than on a core of its own"
    )


def _flags_of(args: argparse.Namespace) -> dict:
    """The parsed flags as plain values (what a spawned rank can receive)."""
    return {key: value for key, value in vars(args).items() if key not in ("handler", "train_parser")}


def rank_spec(flags: dict, run_config: dict | None, report: bool):
    """The spec a spawned rank rebuilds from the launcher's flags (its workload holds closures,
    which do not cross a spawn), with the configuration the launcher printed and checkpoints keep."""
    return replace(train_spec_from_args(argparse.Namespace(**flags), report=report), run_config=run_config)


def train_spec_from_args(args: argparse.Namespace, report: bool = False):
    """The schedule (with --split / --ckpt), the model and the run, checked before any compute."""
    from pipeloom.models.llama import LlamaConfig
    from pipeloom.runtime.training import TrainSpec, check_spec

    if args.plan:
        from pipeloom.cli.plan import spec_from_plan

        spec = _with_run(replace(spec_from_plan(args), report=report, return_parameters=False), args)
        check_spec(spec)
        return spec
    costs = costs_from_args(args)
    schedule = checkpointed(schedule_from_args(args, costs, budget_is_used=passes_use_budget(args)), costs, args)
    counts = None
    if args.layer_counts:
        try:
            counts = tuple(int(x) for x in args.layer_counts.split(","))
        except ValueError:
            raise ConfigError(
                f"--layer-counts must be integers separated by commas, got {args.layer_counts!r}"
            ) from None
    if args.dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {args.dp}")
    workload, config = workload_from_args(args, counts)
    spec = TrainSpec(
        schedule=schedule,
        config=config or LlamaConfig(),
        workload=workload,
        dp=args.dp,
        tp=args.tp or 1,
        layer_counts=counts,
        concat_w=args.concat_w,
        report=report,
        return_parameters=False,
        **run_options(args),
    )
    spec = _with_run(spec, args)
    check_spec(spec)
    return spec


def _with_run(spec, args: argparse.Namespace):
    """The spec with its held-out data and the effective configuration (printed once, by the caller)."""
    from pipeloom.cli.config_file import effective_config
    from pipeloom.cli.model import eval_batch_of

    parser = getattr(args, "train_parser", None)
    config = effective_config(args, parser) if parser is not None else None
    return replace(spec, eval_data=eval_batch_of(args, spec.resolved_workload()), run_config=config)


def write_train_outputs(results, spec, args: argparse.Namespace) -> None:
    from pipeloom.runtime.report import run_context, run_report, write_summary, write_trace

    if args.trace:
        write_trace(results, args.trace)
    if args.summary:
        write_summary(results, args.summary, spec.peak_tflops, **run_context(spec))
    print(run_report(results, spec))
