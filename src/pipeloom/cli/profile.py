"""`pipeloom profile`: measure a model's layers on this machine (torch) into a profile for `tune`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from pipeloom.cli.args import int_list
from pipeloom.cli.model import add_data_arguments, data_from_args
from pipeloom.cli.output import add_quiet, progress_bar
from pipeloom.cli.parser import add_command
from pipeloom.errors import ConfigError
from pipeloom.files import check_writable
from pipeloom.profile_format import Layout, Profile
from pipeloom.provenance import describe
from pipeloom.tune.pool import default_jobs

__all__ = ["register", "ALLOW_BUSY_ENV"]

ALLOW_BUSY_ENV = "PIPELOOM_ALLOW_BUSY"
"""Set to 1 by a harness whose own work keeps the machine busy (the test suite's parallel workers)."""
HF_SEQ_LEN = 128
"""Tokens per sequence a Hugging Face model is profiled at without --seq-len."""


def register(commands) -> None:
    parser = add_command(
        commands,
        "profile",
        "measure a model on this machine; write per-layer costs for `tune` (torch)",
        [
            "pipeloom profile --model examples/tiny-llama.json --mbs 1,2 --layers 1,2 --slices 2,4 --output profile.json",
            "pipeloom profile --model hf:./my-llama --seq-len 256 --mbs 1,2 --layers 1,2 --output prof.json",
            "pipeloom profile --model hf:./my-llama --seq-len 256 --tp 2 --sequence-parallel --output tp-prof.json",
        ],
    )
    add_profile_arguments(parser)
    parser.set_defaults(handler=run)


def add_profile_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        required=True,
        help="hf:DIR (a transformers model: its own layers are timed), or an HF-style config.json of a LLaMA-style "
        "model for the built-in decoder; small enough for this machine",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        help="hf: models: tokens per sequence (default 128; the built-in decoder's is its config's seq_len)",
    )
    data = parser.add_argument_group(
        "hf: models' data (default: synthetic tokens)",
        "a mixture of experts routes the user's tokens unevenly, and a device's stash follows its experts' share",
    )
    add_data_arguments(data)
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="compute type (default fp32)")
    parser.add_argument("--mbs", default="1,2", metavar="LIST", help="micro-batch sizes to measure (default 1,2)")
    parser.add_argument("--layers", default="1,2,3", metavar="LIST", help="layers per stage to measure (default 1,2,3)")
    parser.add_argument(
        "--steps",
        type=int,
        default=2,
        help="timed steps per probe round, each round's two warm-up steps run before them (default 2)",
    )
    parser.add_argument(
        "--max-rounds",
        type=int,
        default=4,
        metavar="N",
        help="rounds a probe may repeat until its medians settle (at least 2; default 4): more on a noisy "
        "machine, 2 for a quick profile",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per rank (default 1; the probes' two ranks' threads must fit the cores)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu: each probe's ranks forked, timed by the host's clock (default); cuda: every stage of a probe on "
        "this one GPU in one process, each op timed by CUDA events (dense models, no --tp, not fp16)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=1,
        metavar="N",
        help="hf: models: also measure the ops on one stage over N tensor-parallel ranks, as `tune --tp N` "
        "then prices them (default 1: none)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: measure that layout with sequence parallelism too (`tune --tp N --sequence-parallel`)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        default=1,
        metavar="N",
        help="hf: rotary models: also measure the ops on one stage over N context-parallel ranks (each a share of "
        "every sequence, keys and values gathered), as `tune --cp N` then prices them (default 1: none)",
    )
    parser.add_argument(
        "--slices",
        default="",
        metavar="LIST",
        help="also measure the probes with each micro-batch's sequence in that many causal slices, as svpp and "
        "terapipe plans run them (e.g. 2,4; default none: `tune` then prices a slice as a smaller micro-batch, "
        "marked as beyond the profile)",
    )
    parser.add_argument(
        "--allow-busy",
        action="store_true",
        help="profile even while other processes take the cores (their times read slow; the profile says so). "
        f"Without it a busy machine is refused; {ALLOW_BUSY_ENV}=1 does the same (the test suite sets it)",
    )
    parser.add_argument("--output", default="profile.json", help="where to write the profile (default profile.json)")
    parser.add_argument("--force", action="store_true", help="overwrite the output if it exists")
    add_quiet(parser)


def _hf_profile_model(args: argparse.Namespace):
    """(ModelSpec of the directory's config at --seq-len, probe workloads of its own layers, what
    they train on described: None for synthetic tokens)."""
    from pipeloom.models.hf import CAUSAL, _config_path, hf_workload, load_hf_config
    from pipeloom.tune.presets import model_from_config

    path = args.model[3:]
    config = load_hf_config(path)
    seq_len = HF_SEQ_LEN if args.seq_len is None else args.seq_len
    tokens = data_from_args(args, seq_len)  # None: synthetic
    if config.model_type not in CAUSAL or config.model_type == "mamba":
        raise ConfigError(f"profile: the cost model describes decoder transformers, not {config.model_type}")
    data = json.loads(_config_path(path).read_text())
    model = dataclasses.replace(model_from_config(data, name=Path(path).name or "hf"), seq_len=seq_len)
    probes = lambda layers, mbs: hf_workload(path, 0, mbs, seq_len, layers=layers, data=tokens)  # noqa: E731
    return model, probes, describe(tokens.provenance, brief=True) if tokens is not None else None


def run(args: argparse.Namespace) -> int:
    from pipeloom.tune.presets import load_model

    workload_for, trained_on = None, None
    if args.model.startswith("hf:"):
        model, workload_for, trained_on = _hf_profile_model(args)
    else:
        model = load_model(args.model)
        if args.data or args.tokenizer or args.data_dtype:
            raise ConfigError("--data feeds hf: models' probes; the built-in decoder trains on synthetic tokens")
        if args.seq_len is not None:
            raise ConfigError(
                f"--seq-len is for hf: models; the built-in decoder runs its config's sequence ({model.seq_len} "
                f"tokens in {args.model}): change seq_len there"
            )
    if model.params > 5e8:
        raise ConfigError(f"{model.name} has {model.params / 1e9:.1f}B parameters: too large to run on this machine")
    if workload_for is None and (not model.gated or model.kv_heads is not None or model.flash_attention):
        raise ConfigError(
            "the built-in decoder is LLaMA-style (gated, without GQA); profile other models as --model hf:DIR"
        )
    sizes, layers = sorted(set(int_list(args.mbs, "--mbs"))), sorted(set(int_list(args.layers, "--layers")))
    if len(layers) < 2 or min(layers) < 1 or not sizes or min(sizes) < 1 or args.steps < 1 or args.threads < 1:
        raise ConfigError(  # one layer count, however often given, fits no slope per layer
            "profile needs at least two different layer counts >= 1 (--layers 1,2), micro-batch sizes >= 1, "
            "--steps >= 1 and --threads >= 1"
        )
    cores = default_jobs()
    if args.device == "cpu" and args.threads > 1 and 2 * args.threads > cores:
        raise ConfigError(  # their ops would wait for cores, which the contention check reads as a busy machine
            f"--threads {args.threads}: the probes' two ranks of {args.threads} threads each would share this "
            f"machine's {cores} cores and read slow; use --threads {max(1, cores // 2)} or fewer"
        )
    if args.max_rounds < 2:
        raise ConfigError(
            f"--max-rounds must be at least 2 (a median settles between two rounds), got {args.max_rounds}"
        )
    if args.tp < 1 or (args.tp > 1 and workload_for is None) or (args.sequence_parallel and args.tp == 1):
        raise ConfigError(
            f"--tp {args.tp}{' --sequence-parallel' if args.sequence_parallel else ''}: tensor parallelism is "
            "measured at --tp N > 1 on a Hugging Face model (--model hf:DIR)"
        )
    layouts = [(args.tp, False), *([(args.tp, True)] if args.sequence_parallel else [])] if args.tp > 1 else []
    if args.cp < 1 or (args.cp > 1 and workload_for is None) or model.seq_len % (2 * args.cp):
        raise ConfigError(
            f"--cp {args.cp}: context parallelism is measured at --cp N > 1 on a Hugging Face model (--model hf:DIR) "
            f"whose sequence cuts into 2N equal chunks (--seq-len {model.seq_len})"
        )
    slices = int_list(args.slices, "--slices") if args.slices else []
    if any(count < 2 or model.seq_len % count for count in slices):
        raise ConfigError(
            f"--slices {args.slices}: each slice count must be at least 2 and divide the sequence length "
            f"({model.seq_len} tokens)"
        )
    check_writable(args.output)
    if os.path.exists(args.output) and not args.force:  # a profile can take hours: never lost to a rerun
        raise ConfigError(f"{args.output} already exists: pass --force to overwrite it, or --output elsewhere")
    from pipeloom.profile.profiler import profile_model
    from pipeloom.tune.profiled import ProfiledCostModel, profile_costs_keys

    try:
        profile = profile_model(
            model,
            sizes,
            layers,
            args.steps,
            args.threads,
            progress=progress_bar("profile", args.quiet, "probe"),
            workload_for=workload_for,
            dtype=args.dtype,
            max_rounds=args.max_rounds,
            allow_busy=args.allow_busy or os.environ.get(ALLOW_BUSY_ENV) == "1",
            tensor_parallel=layouts,
            context_parallel=[args.cp] if args.cp > 1 else [],
            slices=slices,
            device=args.device,
        )
    except ConfigError as error:  # the runtime's checks of a probe's run speak for `train`
        if not error.summary.startswith("train: "):
            raise
        raise ConfigError(f"profile: {error.summary.removeprefix('train: ')}") from None
    if workload_for is not None:
        profile = dataclasses.replace(profile, source=args.model, data=trained_on)
    priced = ProfiledCostModel(profile)
    data = profile.to_dict() | profile_costs_keys(priced)
    Path(args.output).write_text(json.dumps(data, indent=1) + "\n")
    for size, fit in profile.plain.fits.items():
        activation = fit["M_B"].per_layer / 2**20
        fused = f" (fused BW {fit['BW'].per_layer:.3f} ms)" if "BW" in fit else ""
        print(
            f"mbs {size}: per layer F {fit['F'].per_layer:.3f} ms, B {fit['B'].per_layer:.3f} ms, "
            f"W {fit['W'].per_layer:.3f} ms{fused}, R {fit['R'].per_layer:.3f} ms, activations {activation:.2f} MiB; "
            f"p2p {priced.p2p_ms(size):.3f} ms"
        )
    for layout, measured in profile.layouts.items():
        for size, fit in measured.fits.items() if layout != Layout() else ():
            what = "(waits in collectives included)"
            if layout.slices > 1:
                what = f"in {layout.slices} slices, per slice"
            elif "a2a_F" in fit and "a2a_B" in fit:
                what = f"beside all-to-alls in flight {fit['a2a_F'].per_layer:.3f} ms in F, "
                what += f"{fit['a2a_B'].per_layer:.3f} ms in B"
            print(
                f"mbs {size} on {layout.key}: per layer F {fit['F'].per_layer:.3f} ms, "
                f"B {fit['B'].per_layer:.3f} ms, W {fit['W'].per_layer:.3f} ms {what}"
            )
    print(runtime_line(profile))
    print(noise_line(profile))
    if profile.data:
        print(f"data: the probes trained on {profile.data}")
    for warning in profile.warnings:
        print(f"pipeloom: profile: warning: {warning}", file=sys.stderr)
    print(f"profile written to {args.output}")
    return 0


def runtime_line(profile: Profile) -> str:
    """What the runtime adds beyond the ops, as measured."""
    links, overheads = profile.links, profile.overheads
    p2p, reduce, optimizer = links.p2p, links.allreduce, overheads.optimizer
    return (
        f"runtime: {overheads.op_ms:.3f} ms per op; p2p {p2p.latency_ms:.3f} ms + "
        f"{p2p.bytes_per_ms / 1e6:.2f} GB/s; all-reduce (dp {links.dp}) {reduce.latency_ms:.3f} ms + "
        f"{reduce.bytes_per_ms / 1e6:.2f} GB/s; optimizer {optimizer.base_ms:.2f} ms + "
        f"{optimizer.per_param_ms * 1e6:.3f} ms per M parameters; rest of a step "
        f"{overheads.step.base_ms:.2f} ms + {overheads.step.per_param_ms * 1e6:.3f} ms per M parameters its "
        "replicas zero"
    )


def noise_line(profile: Profile) -> str:
    """How noisy the machine was while it was measured."""
    noise = profile.noise
    unsettled = f", {noise.unsettled} never settled" if noise.unsettled else ""
    cores = f"; ops ran at {noise.wall_over_cpu:.2f}× their CPU time" if noise.wall_over_cpu is not None else ""
    kept = "kept" if noise.busy_allowed else "dropped"
    dropped = f", {noise.busy_rounds} busy round(s) {kept}" if noise.busy_rounds else ""
    spells = f"; {1 - noise.steady_share:.0%} of steps ran in slow spells, left out" if noise.steady_share < 1 else ""
    return (
        f"noise: op times spread {noise.median_spread:.1%} (median over probes, worst {noise.worst_spread:.1%}; "
        f"interquartile range / median); {noise.rounds} rounds over {noise.probes} probes{unsettled}"
        f"{cores}{dropped}{spells}"
    )
