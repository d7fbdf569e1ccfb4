"""`pipeloom tune`: which plan for this model and cluster — a ranked table, plan.json, a plot."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from dataclasses import replace
from functools import partial
from pathlib import Path

from pipeloom.budget import parse_memory_budget
from pipeloom.cli.args import int_list, parse_bandwidth
from pipeloom.cli.output import add_quiet, num, progress_bar, table
from pipeloom.cli.parser import add_command
from pipeloom.errors import ConfigError
from pipeloom.files import check_writable
from pipeloom.tune.space import DEFAULT_SCHEMES, RUNNABLE_SCHEMES, SCHEMES, power_of_two_sizes
from pipeloom.tune.topology import Split
from pipeloom.units import MemoryScale, bytes_scale

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "tune",
        "which plan for this model and cluster: search, rank, write plan.json and its timeline",
        [
            "pipeloom tune --model gpt3-13b --hardware a100-40g --devices 32 --global-batch 128 --explain",
            "pipeloom tune --costs profile.json --devices 2 --memory 1GiB --global-batch 8 --runnable",
            "pipeloom tune --model llama2-7b --hardware h100 --devices 16 --global-batch 64 --output plans/l7b.json --force",
        ],
    )
    add_tune_arguments(parser)
    data = parser.add_argument_group("the run's data, recorded in the plan for `train --plan`")
    data.add_argument("--data", metavar="PATH", help="a token file (uint16/uint32 ids), or text with --tokenizer")
    data.add_argument("--tokenizer", metavar="DIR", help="a tokenizer directory for a text --data file")
    data.add_argument("--data-dtype", choices=("uint16", "uint32"), help="token file id type (default uint16)")
    parser.set_defaults(handler=run)


def add_tune_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="a preset (gpt3-13b, llama2-13b, ...) or an HF-style config.json")
    parser.add_argument("--devices", type=int, required=True, help="GPUs (or ranks) in all")
    parser.add_argument("--memory", help="memory per device, e.g. 40GiB (default: the hardware's)")
    parser.add_argument(
        "--host-memory",
        metavar="SIZE",
        help="host memory per device for offloaded optimizer state, e.g. 128GiB (default: the hardware's, "
        "a node's memory over its GPUs; a profile's: unlimited, as it plans no offload)",
    )
    parser.add_argument("--global-batch", type=int, required=True, help="samples per optimizer step")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--hardware", help="a hardware preset: a100-40g, a100-80g, h100, h200, rtx-4090")
    source.add_argument("--costs", metavar="PROFILE", help="a profile JSON written by `pipeloom profile`")
    split = parser.add_argument_group(
        "how each stage's ranks are cut: searched by default; a value or a list (e.g. --tp 4 or --tp 2,4) constrains it"
    )
    split.add_argument(
        "--tp",
        metavar="LIST",
        help="tensor-parallel sizes (default: every one that divides a node and the model's heads and MLP; "
        "with --costs, those the profile measured)",
    )
    split.add_argument(
        "--cp",
        metavar="LIST",
        help="context-parallel sizes: each stage's sequence cut over cp ranks (default: every one that leaves "
        "each rank at least 1024 tokens; with --costs, 1)",
    )
    split.add_argument(
        "--ep",
        metavar="LIST",
        help="expert-parallel sizes for a mixture-of-experts model: its experts shared out over EP data-parallel "
        "replicas, whose all-to-alls the plan prices (default: every one up to a node that divides the experts; "
        "with --costs, those the profile measured)",
    )
    split.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="price sequence parallelism under tp > 1 (all-gather / reduce-scatter for each all-reduce)",
    )
    parser.add_argument("--seq-len", type=int, help="the training sequence length (default: the model's)")
    topology = parser.add_argument_group("the cluster's shape (default: the hardware preset's)")
    topology.add_argument("--gpus-per-node", type=int, metavar="N", help="GPUs per node, joined by NVLink")
    topology.add_argument(
        "--intra-bw", metavar="GB/s", help="bandwidth between GPUs of a node, per GPU and direction, e.g. 450GB/s"
    )
    topology.add_argument("--inter-bw", metavar="GB/s", help="network bandwidth between nodes, per GPU, e.g. 50GB/s")
    parser.add_argument(
        "--schemes", help=f"comma-separated among {', '.join(SCHEMES)} (default: {','.join(DEFAULT_SCHEMES)})"
    )
    parser.add_argument("--runnable", action="store_true", help="only schemes the runtime executes today")
    parser.add_argument("--pp", metavar="LIST", help="pipeline sizes to try (default: every divisor)")
    parser.add_argument("--max-mbs", type=int, default=32, help="largest micro-batch size to try (powers of two)")
    parser.add_argument(
        "--no-memory-passes", action="store_true", help="do not try Mario, T-Recomp or T-Offload where memory is short"
    )
    parser.add_argument(
        "--no-static-measures",
        action="store_true",
        help="do not try ZeRO-1/2 or host-stepped optimizers where static memory is short",
    )
    parser.add_argument("--top", type=int, default=10, help="plans to rank (default 10)")
    parser.add_argument("--output", default="plan.json", help="where to write the best plan (default plan.json)")
    parser.add_argument("--force", action="store_true", help="overwrite the plan and its timeline if they exist")
    parser.add_argument("--plot", help="the best plan's timeline (default: the output's name with .png)")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="say why the best plan's tp, cp and ep beat their neighbours, which static-memory measures it needs "
        "and what they cost, and why the runner-ups lost",
    )
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON")
    parser.add_argument(
        "--jobs", type=int, help="processes that simulate candidates (default: every core); the ranking is the same"
    )
    add_quiet(parser)


def shared_cores(cost_model, devices: int) -> str | None:
    """What to say where `devices` CPU ranks of the profile's threads outnumber the cores it was
    taken on: its probes ran a rank a core, so every plan's ops would run slower than priced."""
    profile = cost_model.profile
    if profile is None or profile.device.kind != "cpu" or not profile.device.cores:
        return None
    threads, cores = profile.device.threads or 1, profile.device.cores
    if devices * threads <= cores:
        return None
    return (
        f"{devices} ranks × {threads} thread(s) on the profile's {cores} cores: the ranks would share them, each op "
        f"up to {devices * threads / cores:.3g}× slower than the plans are priced (each rank its own core, as profiled)"
    )


def routed_elsewhere(cost_model, data: dict | None) -> str | None:
    """What to say where a mixture of experts' profile trained on other tokens than the plan
    will run on: its replicas' stash follows what their experts are routed, which the user's
    text skews; a dense model's does not depend on the tokens."""
    from pipeloom.provenance import describe

    profile = cost_model.profile
    if profile is None or not profile.model.num_experts or not data:
        return None
    planned = describe(data, brief=True)
    if profile.data == planned:
        return None
    return (
        f"the profile's probes trained on {profile.data or 'synthetic tokens'}, the plan on {planned}: a mixture of "
        f"experts' stash follows its routing, so `profile --data {data.get('path', 'PATH')}` measures it as it will run"
    )


def run(args: argparse.Namespace) -> int:
    from pipeloom.cli.run_inputs import plan_inputs
    from pipeloom.tune.plan import plan_from_evaluation
    from pipeloom.tune.profiled import ProfiledCostModel
    from pipeloom.tune.search import tune
    from pipeloom.viz.plot import check_plot_path, has_matplotlib, pyplot

    tps, cps, eps = (int_list(value, f"--{name}") if value else None for name, value in _split_flags(args))
    if args.sequence_parallel and tps is not None and max(tps) < 2:  # as train refuses it: a plan it would not run
        raise ConfigError("--sequence-parallel shards the sequence over a tensor-parallel group: add --tp N (N > 1)")
    jobs = [(args.jobs, "--jobs")] if args.jobs is not None else []
    counts = [(args.devices, "--devices"), (args.global_batch, "--global-batch"), (args.max_mbs, "--max-mbs")]
    for value, what in [*counts, (args.top, "--top"), *jobs]:
        if value < 1:
            raise ConfigError(f"{what} must be at least 1, got {value}")
    cost_model = _cost_model(args)
    splits = _splits(args, cost_model, tps, cps, eps)
    memory = _memory(args, cost_model)
    host_memory = _host_memory(args, cost_model)
    profile = cost_model.profile if isinstance(cost_model, ProfiledCostModel) else None
    model = cost_model.model
    inputs = plan_inputs(
        args.data,
        args.tokenizer,
        args.data_dtype,
        profile.dtype if profile else None,
        model.vocab,
        model.seq_len,
        device=profile.device.kind if profile else None,
        threads=profile.device.threads if profile else None,
    )
    schemes = args.schemes.split(",") if args.schemes else list(DEFAULT_SCHEMES)
    if args.runnable:
        schemes = [name for name in schemes if name in RUNNABLE_SCHEMES]
        if model.router_loss:  # train refuses slices for it: no sliced scheme is a plan it runs
            schemes = [name for name in schemes if 1 in SCHEMES[name].slices]
    if args.plot:
        check_plot_path(args.plot)
        pyplot()  # asked for: refuse now if matplotlib is missing, not after the search
    plot = args.plot or (str(Path(args.output).with_suffix(".png")) if has_matplotlib() else None)
    check_writable(args.output, plot)
    existing = [path for path in (args.output, plot) if path and os.path.exists(path)]
    if existing and not args.force:
        raise ConfigError(
            f"{' and '.join(existing)} already exist(s): pass --force to overwrite, or --output elsewhere"
        )
    expert = any(split.ep > 1 for split in splits)
    result = tune(
        cost_model,
        args.devices,
        memory,
        args.global_batch,
        splits=splits,
        schemes=schemes,
        pp_values=int_list(args.pp, "--pp") if args.pp else None,
        micro_batches=power_of_two_sizes(args.max_mbs),
        keep=args.top,
        memory_passes=not args.no_memory_passes,
        static_measures=not args.no_static_measures and not (args.runnable and expert),  # EP runs ZeRO-0
        progress=progress_bar("tune", args.quiet, "candidate"),
        jobs=args.jobs,
        host_memory=host_memory,
        refuse=partial(_train_refusal, cost_model, args, inputs, memory) if args.runnable else None,
    )
    best = result.best
    priced = result.cost_model_of(best)
    plan = replace(plan_from_evaluation(best, result, priced.model, priced.to_dict()), inputs=inputs)
    if plan.tp > 1 and isinstance(priced, ProfiledCostModel):  # measured collectives: the runtime checks them
        times, sent = priced.tp_step(plan.schedule, plan.partition, plan.micro_batch_size)
        plan.predicted["tp_comm_ms"], plan.predicted["tp_sent_bytes"] = times, sent
    if plan.model.expert_parallel > 1 and isinstance(priced, ProfiledCostModel):  # the runtime reports them
        plan.predicted["a2a_ms"] = priced.a2a_step(plan.schedule, plan.partition, plan.micro_batch_size)
    plan.save(args.output)
    if plot:
        from pipeloom.viz.plot import plot_timeline

        assert best.timeline is not None, "the plan's timeline was restored above"
        plot_timeline(best.timeline, plot, lanes=best.offload.lane_ops if best.offload else None)
    if args.json:
        rows = [_row_dict(e, result) | {"step_time_band_ms": b} for e, b in zip(result.ranked, result.bands)]
        print(json.dumps(rows, allow_nan=False))
        return 0
    print(_report(result, args, memory, cost_model))
    if note := routed_elsewhere(cost_model, inputs.data):
        print(f"data: {note}")
    if args.explain:
        from pipeloom.cli.tune_explain import explain

        print(explain(result, memory, priced))
    drawn = (
        f"its timeline to {plot}" if plot else "no timeline (matplotlib is not installed: pip install 'pipeloom[plot]')"
    )
    print(f"\nbest plan written to {args.output}, {drawn}")
    return 0


def _train_refusal(cost_model, args: argparse.Namespace, inputs, memory: float, evaluation) -> str | None:
    """What `train --plan` would refuse this plan for, checked as train checks it (None: it runs
    it): so `tune --runnable` writes no plan that train then refuses. A plan of a model train
    cannot build by itself (a large preset, for an engine or `--model hf:DIR`) is not checked."""
    from pipeloom.runtime.plan_run import builds_its_own_model, spec_from_plan
    from pipeloom.runtime.spec_checks import check_spec
    from pipeloom.tune.evaluation import TuneResult
    from pipeloom.tune.plan import plan_from_evaluation

    lone = TuneResult([evaluation], [], args.global_batch, memory)
    priced = cost_model.with_split(evaluation.candidate.split)
    plan = replace(plan_from_evaluation(evaluation, lone, priced.model, priced.to_dict()), inputs=inputs)
    if not builds_its_own_model(plan):
        return None
    try:
        check_spec(spec_from_plan(plan), on_this_device=False)
    except ConfigError as error:
        return error.summary.removeprefix("train: ")
    return None


def _split_flags(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    return [("tp", args.tp), ("cp", args.cp), ("ep", args.ep)]


def _cost_model(args: argparse.Namespace):
    """The cost model of the unsplit plan: a profile's, or a preset's on the cluster as given."""
    from pipeloom.tune.cost_model import AnalyticCostModel
    from pipeloom.tune.presets import load_hardware, load_model

    topology = [(args.gpus_per_node, "--gpus-per-node"), (args.intra_bw, "--intra-bw"), (args.inter_bw, "--inter-bw")]
    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len must be at least 1, got {args.seq_len}")
    if args.costs:
        from pipeloom.tune.profiled import ProfiledCostModel

        given = [flag for value, flag in topology if value is not None]
        if given:
            raise ConfigError(
                f"{given[0]} shapes a preset's cluster; {args.costs} prices this machine's own measured links "
                "(drop it, or plan with --hardware)"
            )
        if "=" in args.costs and not Path(args.costs).exists():
            raise ConfigError(
                f"tune --costs takes a profile (`pipeloom profile`), not costs written out ({args.costs}): those "
                "price one schedule, in `pipeloom simulate` and `compare`"
            )
        profiled = ProfiledCostModel.load(args.costs, 1, args.sequence_parallel)
        if args.model and load_model(args.model).to_dict() != profiled.model.to_dict():
            raise ConfigError(f"--model {args.model} differs from the model profiled in {args.costs}")
        if args.seq_len is not None and args.seq_len != profiled.model.seq_len:
            raise ConfigError(
                f"--seq-len {args.seq_len}: {args.costs} was profiled on sequences of {profiled.model.seq_len} tokens; "
                f"profile again with `--seq-len {args.seq_len}`"
            )
        return profiled
    if not args.model:
        raise ConfigError("tune needs --model (a preset or config.json) with --hardware, or --costs PROFILE")
    if not args.hardware:
        raise ConfigError("tune needs --hardware NAME or --costs PROFILE to turn FLOPs into time")
    model, hardware = load_model(args.model), load_hardware(args.hardware)
    if args.seq_len is not None:
        model = replace(model, seq_len=args.seq_len)
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be at least 1, got {args.gpus_per_node}")
        hardware = replace(hardware, gpus_per_node=args.gpus_per_node)
    if args.intra_bw is not None:
        hardware = replace(hardware, nvlink_bandwidth=parse_bandwidth(args.intra_bw, "--intra-bw"))
    if args.inter_bw is not None:
        hardware = replace(hardware, network_bandwidth=parse_bandwidth(args.inter_bw, "--inter-bw"))
    return AnalyticCostModel(model, hardware, sequence_parallel=args.sequence_parallel)


def _splits(args: argparse.Namespace, cost_model, tps, cps, eps) -> list:
    """The splits to search: the flags' values as constraints, the rest by default (a profile's:
    those it measured); each checked against the model in one line."""
    from pipeloom.tune.profiled import ProfiledCostModel
    from pipeloom.tune.topology import model_splits

    model = cost_model.model
    gpus_per_node = getattr(getattr(cost_model, "hardware", None), "gpus_per_node", args.devices)
    if isinstance(cost_model, ProfiledCostModel):
        measured = cost_model.measured_splits(args.sequence_parallel)
        if tps is None and cps is None and eps is None:  # what the profile measured, one dimension at a time
            found = [split for split in measured if args.devices % split.ranks == 0]
            return _with_sequence_parallel(args, found)
        tps, cps, eps = tps or [1], cps or [1], eps or [1]  # a flag given: the others as profiled plainly
        if max(eps) > 1 and cost_model.expert_layout is None:
            raise ConfigError(
                f"{args.costs} measured no expert all-to-all: profile the MoE model with `profile --model hf:DIR`"
            )
    # --runnable: only the runtime needs the vocabulary whole
    found = model_splits(model, args.devices, gpus_per_node, tp=tps, cp=cps, ep=eps, whole_vocabulary=args.runnable)
    found = _with_sequence_parallel(args, found)
    if isinstance(cost_model, ProfiledCostModel):  # the flags are valid: say what they ask beyond the profile
        measured = cost_model.measured_splits(args.sequence_parallel)
        unmeasured = [split.tp for split in found if split.tp > 1 and Split(split.tp) not in measured]
        if unmeasured:
            layout = f"--tp {unmeasured[0]}{' --sequence-parallel' if args.sequence_parallel else ''}"
            print(
                f"pipeloom: tune: warning: {args.costs} measured no ops on {unmeasured[0]} tensor-parallel ranks: they "
                f"are estimated as 1/{unmeasured[0]} of the compute plus the collectives timed alone, which on CPU "
                f"ranks read 2.5x fast; `profile {layout}` measures them",
                file=sys.stderr,
            )
    return found


def _with_sequence_parallel(args: argparse.Namespace, found: list) -> list:
    """`found`, unless --sequence-parallel is asked of splits without tensor parallelism."""
    if args.sequence_parallel and max(split.tp for split in found) < 2:
        raise ConfigError("--sequence-parallel shards the sequence over a tensor-parallel group: add --tp N (N > 1)")
    return found


def _one_size(text: str, flag: str, example: str) -> float:
    budget = parse_memory_budget(text)
    if isinstance(budget, list):
        raise ConfigError(f"{flag} takes one size for every device, e.g. {example}")
    return budget


def _memory(args: argparse.Namespace, cost_model) -> float:
    if args.memory:
        return _one_size(args.memory, "--memory", "40GiB")
    device_memory = getattr(getattr(cost_model, "hardware", None), "memory", None)
    if device_memory is None:
        raise ConfigError("give --memory (e.g. 40GiB): the profile does not say how much the devices have")
    return device_memory


def _host_memory(args: argparse.Namespace, cost_model) -> float:
    if args.host_memory:
        return _one_size(args.host_memory, "--host-memory", "128GiB")
    return getattr(getattr(cost_model, "hardware", None), "host_memory", math.inf)


def _row(e, result, scale: MemoryScale) -> list:
    return [
        e.candidate.label,
        num(round(e.step_time, 2)),
        f"{result.throughput(e):.3g}",
        scale.number(max(e.peak_memory)),
        scale.number(min(e.peak_memory)),
        scale.number(max(e.host_memory, default=0.0)),
        f"{e.bubble_rate:.1%}",
    ]


def _row_dict(e, result) -> dict:
    return {
        "plan": e.candidate.label,
        "scheme": e.candidate.scheme,
        "pp": e.candidate.pp,
        "dp": e.candidate.dp,
        "tp": e.candidate.split.tp,
        "cp": e.candidate.split.cp,
        "ep": e.candidate.split.ep,
        "micro_batch_size": e.candidate.micro_batch,
        "chunks": e.candidate.chunks,
        "slices": e.candidate.slices,
        "passes": list(e.candidate.passes),
        "zero": e.candidate.zero,
        "static_memory": e.static_memory,
        "step_time_ms": e.step_time,
        "throughput": result.throughput(e),
        "peak_memory": e.peak_memory,
        "host_memory": e.host_memory or [0.0] * len(e.peak_memory),
        "bubble_rate": e.bubble_rate,
        "partition": e.partition,
        "extrapolated": list(e.extrapolated),
        "memory_unit": "bytes",
    }


def _report(result, args, memory: float, cost_model) -> str:
    reasons = Counter(e.reason.split(":")[0] for e in result.rejected)
    host = f" (host {result.host_memory / 2**30:.0f} GiB each)" if math.isfinite(result.host_memory) else ""
    head = (
        f"{cost_model.model.name} on {args.devices} × {cost_model.source}, {memory / 2**30:.2f} GiB each{host}, "
        f"global batch {args.global_batch}: simulated {result.evaluated}, pruned {result.pruned}, "
        f"ruled out {len(result.rejected)}"
        + (f" ({', '.join(f'{n} {r}' for r, n in reasons.items())})" if reasons else "")
    )
    scale = bytes_scale(peak for e in result.ranked for peak in e.peak_memory)  # a small model's reads in MiB
    headers = ["plan", "step ms", "samples/s", f"max {scale.unit}", f"min {scale.unit}", f"host {scale.unit}", "bubble"]
    rows = [
        [f"{i + 1}. {'~' if e.extrapolated else ''}{row[0]}", *row[1:]]
        for i, (e, row) in enumerate((e, _row(e, result, scale)) for e in result.ranked)
    ]
    if any(result.bands):  # a measured profile: how far each step can be trusted
        headers.insert(2, "± ms")
        for row, width in zip(rows, result.bands):
            row.insert(2, f"{width:.2f}")
    best = result.best
    note = f"\nnear-tie: {result.tie_note}" if result.tie_note else ""
    if result.extrapolation_note:
        note += f"\nbeyond the profile: {result.extrapolation_note}"
    if shared := shared_cores(cost_model, args.devices):
        note += f"\nshared cores: {shared}"
    return f"{head}\n\n{table(headers, rows)}\n\nbest: {best.candidate.label}, layers per stage {best.partition}{note}"
