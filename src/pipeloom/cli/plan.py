"""`train --plan`: run what `tune` chose, then put the measurement beside the prediction."""

from __future__ import annotations

import argparse
import json
import statistics
from itertools import compress

from pipeloom.errors import ConfigError

__all__ = ["spec_from_plan", "fidelity_report"]

_SCHEDULE_FLAGS = (
    "name",
    "schedule_flag",
    "p",
    "m",
    "chunks",
    "slices",
    "forwards",
    "schedule_file",
    "split",
    "layer_counts",
)


def spec_from_plan(args: argparse.Namespace):
    """The TrainSpec of a plan (`pipeloom.runtime.spec_from_plan`); schedule and model flags
    would contradict it, so they are refused."""
    from pipeloom.cli.model import data_from_args
    from pipeloom.cli.train_args import run_options
    from pipeloom.runtime.plan_run import spec_from_plan as plan_spec
    from pipeloom.tune.plan import Plan

    if any(getattr(args, flag, None) for flag in _SCHEDULE_FLAGS) or args.ckpt != "none":
        raise ConfigError("--plan fixes the schedule and the model: drop the other schedule options")
    plan = Plan.load(args.plan)
    given = getattr(args, "given", ())  # flags given on the command line, whatever their value
    ep = plan.model.expert_parallel if plan.model.num_experts else 1
    for name, value in (("tp", plan.tp), ("cp", plan.cp), ("ep", ep)):
        if getattr(args, name, None) is not None and getattr(args, name) != value:
            raise ConfigError(f"--plan fixes {name} = {value}: drop --{name} {getattr(args, name)}")
    if args.sequence_parallel and not plan.sequence_parallel:
        raise ConfigError("--plan fixes sequence parallelism off: drop --sequence-parallel")
    for flag, dest, what, value in (
        ("--dp", "dp", "dp", plan.dp),
        ("--microbatch-size", "microbatch_size", "the micro-batch size", plan.micro_batch_size),
        ("--seq-len", "seq_len", "the sequence length", plan.model.seq_len),
    ):
        asked = getattr(args, dest)
        if dest in given and asked != value:
            raise ConfigError(f"--plan fixes {what} = {value}: drop {flag} {asked}")
    fields = run_options(args)
    fields.pop("cp", None)  # checked against the plan's above
    fields.pop("sequence_parallel", None)  # the plan's (the flag's default would turn a plan's off)
    if "zero" not in given:  # the plan's static-memory measures, unless the flags ask for others
        del fields["zero"]
    elif args.zero != plan.zero:
        _replaced("zero", args.zero, f"ZeRO-{plan.zero}")
    planned = plan.inputs
    if args.dtype is None:  # the type the plan's costs were measured in
        del fields["dtype"]
    elif planned.dtype and args.dtype != planned.dtype:
        _replaced("dtype", args.dtype, planned.dtype)
    if "threads" not in given:  # the threads a rank the plan's costs were measured with
        del fields["threads"]
    elif planned.threads and args.threads != planned.threads:
        _replaced("threads", args.threads, f"{planned.threads} thread(s) a rank")
    device = args.device or "cpu"
    if planned.device and device != planned.device:
        print(
            f"device: this run is on {device}, and the plan's prediction is of {planned.device} (its profile's device)",
            flush=True,
        )
    if args.model and args.model.startswith("hf:"):
        changed = _model_changes(plan.model, args.model)
        if changed:
            print(
                f"model: --model {args.model} replaces the plan's ({plan.cost_model.get('model') or plan.model.name}), "
                f"and the plan's prediction is of that one: it was made for {', '.join(changed)}",
                flush=True,
            )
    data = data_from_args(args, plan.model.seq_len)
    recorded = planned.data
    if data is not None and recorded:
        from pipeloom.provenance import differences

        for change in differences(recorded, data.provenance):
            print(f"data: --data replaces the plan's: it was made for {change}", flush=True)
    return plan_spec(plan, args.model, data, report=True, **fields)


def _replaced(flag: str, asked, planned: str) -> None:
    """Say that a run option replaces what the plan was priced with, its prediction being of that."""
    print(
        f"{flag}: --{flag} {asked} replaces the plan's {planned}, and the plan's prediction is of {planned}", flush=True
    )


def _model_changes(planned, given: str) -> list[str]:
    """How the Hugging Face model `given` ("hf:DIR") differs in shape from the `planned` one:
    "ffn 128, not 256" per field (empty: the same shape; the sequence is the plan's either way)."""
    from pipeloom.models.hf import _config_path
    from pipeloom.tune.presets import model_from_config

    try:
        now = model_from_config(json.loads(_config_path(given[3:]).read_text()))
    except (OSError, ValueError, ConfigError):
        return []  # building the run refuses it in its own words

    def shape(model) -> dict:
        return {
            "hidden": model.hidden,
            "layers": model.layers,
            "heads": model.heads,
            "kv_heads": model.kv_heads or model.heads,  # None: a head of K and V per query head
            "ffn": model.ffn,
            "vocab": model.vocab,
            "experts": model.num_experts,
        }

    before, after = shape(planned), shape(now)
    return [f"{name} {before[name]}, not {after[name]}" for name in before if before[name] != after[name]]


def fidelity_report(plan, results) -> str:
    """Measured step time, peak stash and static bytes per device beside the plan's prediction."""
    from pipeloom.profile.steadiness import timed_steps
    from pipeloom.runtime.layout import RankLayout
    from pipeloom.runtime.plan_run import last_pipeline_phases

    predicted = plan.predicted
    replicas = plan.dp * plan.cp  # every copy of the weights: data- and context-parallel ranks
    p, layout = plan.pp, RankLayout(plan.pp, replicas, plan.tp, plan.cp)
    times = timed_steps(results[0].step_seconds)  # warm-up left out, as the profile measured
    steady = _steady(results, len(times))
    measured = 1e3 * statistics.median(t for t, kept in zip(times, steady) if kept)
    expected = predicted.get("step_time_ms")
    lines = ["", "fidelity (predicted by the plan vs measured):"]
    if expected:
        lines.append(
            f"  step time   {expected:9.1f} ms  vs {measured:9.1f} ms  ({measured / expected - 1:+.1%}; "
            f"{_band(predicted)}{_noise(times)}{_spells(times, steady)})"
        )
        pipeline_ranks = [results[layout.rank(0, d)] for d in range(p)]
        lines += _breakdown(predicted, list(compress(timed_steps(last_pipeline_phases(pipeline_ranks)), steady)))
        lines.append(_why(plan, pipeline_ranks, steady, measured))
    peaks = predicted.get("peak_activation_memory") or []
    for device in range(p):
        stash = max(
            max(r.peak_stash_bytes for r in results[layout.rank(replica, device)].records)
            for replica in range(replicas)
        )
        if device < len(peaks) and peaks[device]:
            lines.append(
                f"  device {device} activations {peaks[device] / 2**20:8.2f} MiB vs {stash / 2**20:8.2f} MiB "
                f"({stash / peaks[device] - 1:+.1%})"
            )
    statics = predicted.get("static_memory") or []
    for device in range(p):  # weights, gradients and optimizer state the rank holds on its device
        held = [results[layout.rank(replica, device)].static_bytes for replica in range(replicas)]
        if device < len(statics) and statics[device] and all(held):
            device_bytes = max(b["weights"] + b["gradients"] + b["optimizer"] for b in held)
            lines.append(
                f"  device {device} static      {statics[device] / 2**20:8.2f} MiB vs {device_bytes / 2**20:8.2f} MiB "
                f"({device_bytes / statics[device] - 1:+.1%}; weights, gradients, optimizer)"
            )
    tp_sent, tp_ms = predicted.get("tp_sent_bytes") or [], predicted.get("tp_comm_ms") or []
    for device in range(min(p, len(tp_sent))):  # what each rank sends in its tensor-parallel group's collectives
        sent = max(
            results[layout.rank(r, device, t)].records[-1].tp_sent_bytes
            for r in range(replicas)
            for t in range(plan.tp)
        )
        lines.append(
            f"  device {device} TP comm     {tp_sent[device] / 2**20:8.2f} MiB vs {sent / 2**20:8.2f} MiB per step "
            f"({sent / tp_sent[device] - 1:+.1%}; predicted {tp_ms[device]:.1f} ms of collectives)"
        )
    a2a = predicted.get("a2a_ms") or []
    for device in range(min(p, len(a2a))):  # the expert all-to-alls' time in flight, and how much pairs hid
        records = [r for x in range(replicas) for r in results[layout.rank(x, device)].records[1:]]
        if records and a2a[device]:
            flight = statistics.median(r.a2a_ms for r in records)
            hidden = statistics.median(r.a2a_ms - r.a2a_exposed_ms for r in records)
            lines.append(
                f"  device {device} a2a         {a2a[device]:8.2f} ms  vs {flight:8.2f} ms  per step "
                f"({flight / a2a[device] - 1:+.1%}; {hidden:.2f} ms of it hidden under pairs)"
            )
    totals = predicted.get("peak_memory") or []
    for device in range(p):  # on GPUs: everything the rank allocated, against static + activations
        gpu = [results[layout.rank(replica, device)].peak_memory_bytes for replica in range(replicas)]
        if device < len(totals) and totals[device] and all(value is not None for value in gpu):
            lines.append(
                f"  device {device} GPU peak    {totals[device] / 2**20:8.2f} MiB vs {max(gpu) / 2**20:8.2f} MiB "
                f"({max(gpu) / totals[device] - 1:+.1%}; torch.cuda.max_memory_allocated)"
            )
    return "\n".join(lines)


def _why(plan, devices: list, steady: list[bool], measured: float) -> str:
    """Where the pipeline's error comes from (`sim.replay`): the plan's schedule replayed with the
    run's own op times (one replica's devices, the steps kept) splits it into the op times —
    every pass off alike is the machine's speed since the profile, not the plan — their
    variation from step to step, and the runtime's own."""
    from pipeloom.profile.steadiness import timed_steps
    from pipeloom.sim.replay import replay_records

    timed = [timed_steps(result.records) for result in devices]
    steps = [[records[k] for records in timed] for k, kept in enumerate(steady) if kept]
    again = replay_records(plan.schedule, plan.costs, steps)
    return f"  why: {again.explain(measured, plan.predicted.get('speed_noise_ms', 0.0))}"


def _steady(results, timed: int) -> list[bool]:
    """Which of the `timed` steps every rank ran at the machine's own speed
    (`steadiness.steady_steps`): the profile's medians, and so the plan's prediction, are of such
    steps, and the run's are judged by the same rule."""
    from pipeloom.profile.steadiness import steady_steps, step_busy, timed_steps

    steady = steady_steps([step_busy(timed_steps(result.records)) for result in results])
    return steady if len(steady) == timed else [True] * timed


def _spells(times: list[float], steady: list[bool]) -> str:
    """What the steps left out of the median (a slow spell of the host) would have made it."""
    if all(steady):
        return ""
    slow = len(steady) - sum(steady)
    every = 1e3 * statistics.median(times)
    return (
        f"; {slow} step(s) in a slow spell of the host left out, as the profile does: all {len(times)}, {every:.1f} ms"
    )


def _band(predicted: dict) -> str:
    """The prediction's own band, where the plan has one (`tune.confidence`: how well the profile
    knew the op times it was priced by)."""
    band, step = predicted.get("band_ms"), predicted["step_time_ms"]
    return f"the profile's band ±{band / step:.1%}; " if band else ""


def _noise(times: list[float]) -> str:
    """How far the timed steps spread about their median (half their range), and how many there
    were: an error within it says nothing about the plan."""
    from pipeloom.cli.train_args import PLAN_STEPS, TIMED_PLAN_STEPS

    if len(times) < 2:
        return f"1 timed step: no noise to compare; run --steps {PLAN_STEPS} or more"
    middle = statistics.median(times)
    spread = (max(times) - min(times)) / 2 / middle
    few = f"; too few to trust: run --steps {PLAN_STEPS} or more" if len(times) < TIMED_PLAN_STEPS else ""
    return f"the steps' noise ±{spread:.1%} over {len(times)} timed steps{few}"


_PARTS = (  # (plan key, runtime phase, what it is)
    ("pipeline_ms", "pipeline", "the schedule's ops"),
    ("allreduce_ms", "allreduce", "gradients over replicas and tied stages"),
    ("optimizer_ms", "optimizer", "the AdamW step"),
    ("overhead_ms", "overhead", "batch, zeroing gradients, loss all-reduce"),
)


def _breakdown(predicted: dict, phases: list[dict]) -> list[str]:
    """Where a step's time goes, predicted beside measured (the medians of the phases on the rank
    whose pipeline ended last: `runtime.plan_run.last_pipeline_phases`), so a gap shows where it
    comes from."""
    if not phases:
        return []
    lines = []
    for key, phase, what in _PARTS:
        expected = predicted.get(key, 0.0)
        measured = 1e3 * statistics.median(step[phase] for step in phases)
        gap = measured - expected
        lines.append(f"    {phase:<10} {expected:9.1f} ms  vs {measured:9.1f} ms  ({gap:+7.1f} ms; {what})")
    return lines
