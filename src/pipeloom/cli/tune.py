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
from pipeloom.cli.args import int_list
from pipeloom.cli.output import add_quiet, num, progress_bar, table
from pipeloom.cli.parser import add_command
from pipeloom.errors import ConfigError
from pipeloom.files import check_writable
from pipeloom.tune.space import DEFAULT_SCHEMES, RUNNABLE_SCHEMES, SCHEMES, power_of_two_sizes

__all__ = ["register", "static_measures_line"]


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
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size, fixed (default 1)")
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp and --costs: price sequence parallelism (all-gather / reduce-scatter for each all-reduce)",
    )
    parser.add_argument(
        "--schemes", help=f"comma-separated among {', '.join(SCHEMES)} (default: {','.join(DEFAULT_SCHEMES)})"
    )
    parser.add_argument(
        "--ep",
        type=int,
        default=1,
        help="expert-parallel size for a mixture-of-experts model, fixed: its experts shared out over EP "
        "data-parallel replicas, whose all-to-alls the plan prices (with --costs, as profiled; default 1)",
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
        help="say which static-memory measures the best plan needs and what they cost, and why the runner-ups lost",
    )
    parser.add_argument("--json", action="store_true", help="print the ranking as JSON")
    parser.add_argument(
        "--jobs", type=int, help="processes that simulate candidates (default: every core); the ranking is the same"
    )
    add_quiet(parser)


def run(args: argparse.Namespace) -> int:
    from pipeloom.cli.run_inputs import plan_inputs
    from pipeloom.tune.plan import plan_from_evaluation
    from pipeloom.tune.profiled import ProfiledCostModel
    from pipeloom.tune.search import tune
    from pipeloom.viz.plot import check_plot_path, has_matplotlib, pyplot

    if args.sequence_parallel and args.tp < 2:  # as train refuses it: a plan it would not run
        raise ConfigError("--sequence-parallel shards the sequence over a tensor-parallel group: add --tp N (N > 1)")
    cost_model = _cost_model(args)
    if args.tp > 1:  # as train would refuse the plan (the vocabulary: only the runtime needs it whole)
        cost_model.model.check_tensor_parallel(args.tp, vocabulary=args.runnable)
    memory = _memory(args, cost_model)
    host_memory = _host_memory(args, cost_model)
    dtype = cost_model.profile.dtype if isinstance(cost_model, ProfiledCostModel) else None
    model = cost_model.model
    inputs = plan_inputs(args.data, args.tokenizer, args.data_dtype, dtype, model.vocab, model.seq_len)
    schemes = args.schemes.split(",") if args.schemes else list(DEFAULT_SCHEMES)
    if args.runnable:
        schemes = [name for name in schemes if name in RUNNABLE_SCHEMES]
        if model.router_loss:  # train refuses slices for it: no sliced scheme is a plan it runs
            schemes = [name for name in schemes if 1 in SCHEMES[name].slices]
    jobs = [(args.jobs, "--jobs")] if args.jobs is not None else []
    for value, what in [(args.devices, "--devices"), (args.global_batch, "--global-batch"), (args.top, "--top")] + jobs:
        if value < 1:
            raise ConfigError(f"{what} must be at least 1, got {value}")
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
    result = tune(
        cost_model,
        args.devices,
        memory,
        args.global_batch,
        tp=args.tp,
        schemes=schemes,
        pp_values=int_list(args.pp, "--pp") if args.pp else None,
        micro_batches=power_of_two_sizes(args.max_mbs),
        keep=args.top,
        memory_passes=not args.no_memory_passes,
        static_measures=not args.no_static_measures and not (args.runnable and args.ep > 1),  # EP runs ZeRO-0
        ep=args.ep,
        progress=progress_bar("tune", args.quiet, "candidate"),
        jobs=args.jobs,
        host_memory=host_memory,
        refuse=partial(_train_refusal, cost_model, args, inputs, memory) if args.runnable else None,
    )
    best = result.best
    plan = replace(plan_from_evaluation(best, result, cost_model.model, cost_model.to_dict(), args.tp), inputs=inputs)
    if args.tp > 1 and isinstance(cost_model, ProfiledCostModel):  # measured collectives: the runtime checks them
        times, sent = cost_model.tp_step(plan.schedule, plan.partition, plan.micro_batch_size)
        plan.predicted["tp_comm_ms"], plan.predicted["tp_sent_bytes"] = times, sent
    if args.ep > 1 and isinstance(cost_model, ProfiledCostModel):  # measured all-to-alls: the runtime reports them
        plan.predicted["a2a_ms"] = cost_model.a2a_step(plan.schedule, plan.partition, plan.micro_batch_size)
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
    if args.explain:
        print(_explain(result, memory, cost_model))
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
    plan = replace(
        plan_from_evaluation(evaluation, lone, cost_model.model, cost_model.to_dict(), args.tp), inputs=inputs
    )
    if not builds_its_own_model(plan):
        return None
    try:
        check_spec(spec_from_plan(plan), on_this_device=False)
    except ConfigError as error:
        return error.summary.removeprefix("train: ")
    return None


def _cost_model(args: argparse.Namespace):
    from pipeloom.tune.cost_model import AnalyticCostModel
    from pipeloom.tune.presets import load_hardware, load_model

    if args.costs:
        from pipeloom.tune.profiled import ProfiledCostModel

        profiled = ProfiledCostModel.load(args.costs, args.tp, args.sequence_parallel)
        if args.model and load_model(args.model).to_dict() != profiled.model.to_dict():
            raise ConfigError(f"--model {args.model} differs from the model profiled in {args.costs}")
        profiled.model = _with_experts_spread(profiled.model, args.ep)
        if args.tp > 1 and not profiled.tp_measured():
            layout = f"--tp {args.tp}{' --sequence-parallel' if args.sequence_parallel else ''}"
            print(
                f"pipeloom: tune: warning: {args.costs} measured no ops on {args.tp} tensor-parallel ranks: they are "
                f"estimated as 1/{args.tp} of the compute plus the collectives timed alone, which on CPU ranks read "
                f"2.5x fast; `profile {layout}` measures them",
                file=sys.stderr,
            )
        if args.ep > 1 and profiled.expert_layout is None:
            raise ConfigError(
                f"{args.costs} measured no expert all-to-all: profile the MoE model with `profile --model hf:DIR`"
            )
        return profiled
    if not args.model:
        raise ConfigError("tune needs --model (a preset or config.json) with --hardware, or --costs PROFILE")
    if not args.hardware:
        raise ConfigError("tune needs --hardware NAME or --costs PROFILE to turn FLOPs into time")
    if args.tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {args.tp}")
    return AnalyticCostModel(
        _with_experts_spread(load_model(args.model), args.ep), load_hardware(args.hardware), args.tp
    )


def _with_experts_spread(model, ep: int):
    """The model with its experts shared out over `ep` ranks (1: as the preset or profile says)."""
    if ep == 1:
        return model
    if ep < 1:
        raise ConfigError(f"--ep must be at least 1, got {ep}")
    if not model.num_experts:
        raise ConfigError(f"--ep {ep}: {model.name} has no routed experts to share out")
    from dataclasses import replace

    return replace(model, expert_parallel=ep)  # refuses experts that do not divide by ep


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


def _row(e, result) -> list:
    peak = max(e.peak_memory)
    return [
        e.candidate.label,
        num(round(e.step_time, 2)),
        f"{result.throughput(e):.3g}",
        f"{peak / 2**30:.2f}",
        f"{min(e.peak_memory) / 2**30:.2f}",
        f"{max(e.host_memory, default=0.0) / 2**30:.2f}",
        f"{e.bubble_rate:.1%}",
    ]


def _row_dict(e, result) -> dict:
    return {
        "plan": e.candidate.label,
        "scheme": e.candidate.scheme,
        "pp": e.candidate.pp,
        "dp": e.candidate.dp,
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
    headers = ["plan", "step ms", "samples/s", "max GiB", "min GiB", "host GiB", "bubble"]
    rows = [
        [f"{i + 1}. {'~' if e.extrapolated else ''}{row[0]}", *row[1:]]
        for i, (e, row) in enumerate((e, _row(e, result)) for e in result.ranked)
    ]
    if any(result.bands):  # a measured profile: how far each step can be trusted
        headers.insert(2, "± ms")
        for row, width in zip(rows, result.bands):
            row.insert(2, f"{width:.2f}")
    best = result.best
    note = f"\nnear-tie: {result.tie_note}" if result.tie_note else ""
    if result.extrapolation_note:
        note += f"\nbeyond the profile: {result.extrapolation_note}"
    return f"{head}\n\n{table(headers, rows)}\n\nbest: {best.candidate.label}, layers per stage {best.partition}{note}"


def _explain(result, memory: float, cost_model) -> str:
    best = result.best
    lines = ["", static_measures_line(best, memory)]
    if best.candidate.pp == 1:
        lines.append(no_pipeline_line(result, memory, cost_model))
    lines += ["", "why the others lost:"]
    for e in result.ranked[1:]:
        lines.append(f"  {e.candidate.label}: {_lost_on(e, best)}")
    unfit = {label: (step, why) for e in result.ranked + result.rejected for label, step, why in e.unfit}
    faster = sorted((step, label, why) for label, (step, why) in unfit.items() if step < best.step_time)
    for step, label, why in faster[:5]:
        lines.append(f"  {label}: memory, would be {1 - step / best.step_time:.1%} faster but {why[8:]}")
    if lines[-1] == "why the others lost:":
        lines.append("  (no other candidate came close)")
    return "\n".join(lines)


def _lost_on(e, best) -> str:
    """Why a ranked plan is not first: slower, or — predicted faster — priced beyond the profile,
    or within the profile's noise of the first and less robust (`tune.confidence`)."""
    if e.step_time >= best.step_time:
        return f"time, {e.step_time / best.step_time - 1:+.1%} step time"
    faster = f"predicted {1 - e.step_time / best.step_time:.1%} faster"
    if e.extrapolated and not best.extrapolated:
        return f"beyond the profile, {faster} but priced on {'; '.join(e.extrapolated)}"
    from pipeloom.provenance import byte_size
    from pipeloom.tune.confidence import robustness

    (best_memory, best_pp), (memory, pp) = robustness(best), robustness(e)
    why = (
        f"less peak memory ({byte_size(best_memory)} against {byte_size(memory)})"
        if best_memory < memory
        else f"fewer pipeline ranks ({best_pp} against {pp})"
    )
    return f"near-tie, {faster}, within the profile's noise of the first, which needs {why}"


def no_pipeline_line(result, memory: float, cost_model) -> str:
    """Why pure data parallelism won: what the best pipeline would cost here, and where."""
    from pipeloom.tune.search import evaluate
    from pipeloom.tune.space import Candidate

    best = result.best
    piped = next((e for e in result.ranked if e.candidate.pp > 1), None)
    if piped is None and best.candidate.dp % 2 == 0:  # the shortest pipeline on the same devices
        dp = best.candidate.dp // 2
        batch = best.candidate.micro_batch * best.candidate.num_microbatches * best.candidate.dp
        candidate = Candidate("1f1b", 2, dp, best.candidate.micro_batch, batch // (dp * best.candidate.micro_batch))
        piped = evaluate(candidate, cost_model, memory)
    if piped is None or not piped.feasible:
        return "why no pipeline: no pipelined plan fits here"
    return (
        f"why no pipeline: the best pipeline here, {piped.candidate.label}, takes {piped.step_time:.1f} ms per step "
        f"({piped.step_time / best.step_time - 1:+.1%}): its devices idle {piped.bubble_rate:.0%} of the pipeline, "
        f"more than the all-reduce it shrinks saves ({best.allreduce_time:.1f} → {piped.allreduce_time:.1f} ms)"
    )


def static_measures_line(evaluation, memory: float) -> str:
    """Which static-memory measure a plan needs, what it saves over none, and what it costs."""
    chosen, options = evaluation.static_option, evaluation.options
    if chosen is None or not options:
        return "static memory: as planned by the cost model"
    plain = options[0]
    plain_gib, own_gib = max(plain.static_memory) / 2**30, max(evaluation.static_memory) / 2**30
    if chosen is plain:
        return (
            f"static memory: no measure needed — fp32 weights and AdamW on every replica, {own_gib:.2f} GiB "
            f"per device at most (ZeRO-0), within {memory / 2**30:.2f} GiB"
        )
    extra = chosen.allreduce_time + chosen.optimizer_time - plain.allreduce_time - plain.optimizer_time
    if chosen.offload_all:
        extra += evaluation.offload.delay if evaluation.offload else 0.0
        what = "every stage's fp32 master weights and AdamW on the host, stepped in bubbles"
    elif chosen.zero == 1:
        what = f"bf16 weights, fp32 master weights and AdamW sharded over dp={evaluation.candidate.dp}"
    else:
        what = f"bf16 weights and gradients, master weights, AdamW and the fp32 gradient reduce-scattered over dp={evaluation.candidate.dp}"
    if chosen.offload_all:
        price = f"costing {extra:.2f} ms per step (host copies and steps outside the bubbles)"
    elif extra > 0:
        price = f"costing {extra:.2f} ms per step (the all-gather of the weights outweighs the 1/dp optimizer step)"
    else:
        price = f"saving {-extra:.2f} ms per step (the 1/dp optimizer step outweighs the all-gather of the weights)"
    return (
        f"static memory: {chosen.label} — {what}: {own_gib:.2f} GiB per device at most instead of "
        f"{plain_gib:.2f} GiB under ZeRO-0, {price}"
    )
