"""A tuned plan (`pipeloom tune --output plan.json`) as a training run, from Python.

`spec_from_plan` reads the schedule, the partition, dp, tp, ZeRO and offload from the plan and the
model from where its costs came from (a Hugging Face directory the profile recorded, or the
built-in decoder of a small planned LLaMA); `train_plan` runs it. `pipeloom train --plan` is a
thin layer over these. Options a plan fixes (the schedule, the model's cut, dp) are not
arguments; everything else is a `TrainSpec` field.
"""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import ConfigError
from pipeloom.models.llama import llama_config
from pipeloom.passes.offload import t_offload
from pipeloom.runtime.spec import RankResult, TrainSpec
from pipeloom.tune.plan import Plan

__all__ = ["builds_its_own_model", "last_pipeline_phases", "spec_from_plan", "train_plan"]

_FIXED_BY_PLAN = {"schedule", "config", "dp", "tp", "cp", "layer_counts", "workload"}


def spec_from_plan(plan: Plan | str | Path, model: str | None = None, data=None, **options) -> TrainSpec:
    """The run a plan describes. `model`: "hf:DIR" to train a Hugging Face model cut as planned
    (default: the model the plan's profile measured, else the built-in decoder); `data`: a
    `pipeloom.data` source (default: the data the plan records, else synthetic tokens);
    `options`: further `TrainSpec` fields (steps, lr, save_dir, ...; dtype and threads default
    to the type and the torch threads a rank the plan's costs were measured with)."""
    plan = plan if isinstance(plan, Plan) else Plan.load(str(plan))
    known = set(TrainSpec.flat_names())
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(f"train_plan: unknown option(s) {', '.join(unknown)}; TrainSpec takes {sorted(known)}")
    fixed = sorted(set(options) & _FIXED_BY_PLAN)
    if fixed:
        raise ConfigError(f"train_plan: the plan fixes {', '.join(fixed)}; drop them")
    options.setdefault("zero", plan.zero)
    inputs = plan.inputs
    if inputs.dtype:
        options.setdefault("dtype", inputs.dtype)
    if inputs.threads:
        options.setdefault("threads", inputs.threads)
    if data is None and inputs.data:
        from pipeloom.data import open_recorded

        data = open_recorded(inputs.data, plan.model.seq_len, options.get("seed", 0))
    if plan.sequence_parallel:
        options.setdefault("sequence_parallel", True)
    if plan.offload_stages:
        options.setdefault("offload_stages", plan.offload_stages)
    elif "offload" in plan.passes:
        options.setdefault("offload_stages", t_offload(plan.schedule).stages)
    planned = plan.model
    if planned.num_experts:
        options.setdefault("ep", planned.expert_parallel)
    source = model or plan.cost_model.get("model")
    if source and source.startswith("hf:"):
        from pipeloom.models.hf import hf_workload

        if not source[3:]:
            raise ConfigError("train_plan: model hf: needs a path, e.g. hf:./my-llama")
        work = hf_workload(
            source[3:],
            options.get("seed", 0),
            plan.micro_batch_size,
            planned.seq_len,
            plan.partition,
            data,
        )
        return TrainSpec(schedule=plan.schedule, workload=work, dp=plan.dp, tp=plan.tp, cp=plan.cp, **options)
    if plan.cp > 1:
        raise ConfigError(
            f"the plan splits each sequence over cp = {plan.cp} ranks, which needs a model with rotary positions: "
            "give model='hf:DIR' (--model hf:DIR), or plan with --cp 1"
        )
    if plan.tp > 1:
        raise ConfigError(
            f"the plan splits each stage over tp = {plan.tp} ranks, which needs a model with a tensor-parallel plan: "
            "give model='hf:DIR' (--model hf:DIR), or plan with --tp 1"
        )
    if not _is_built_in(planned):
        raise ConfigError(
            f"the built-in decoder is a small LLaMA-style one; plan model {planned.name!r} is not one "
            "(gated, dense, without GQA, under 0.5B parameters): give model='hf:DIR', or plan from its profile"
        )
    config = llama_config(planned, planned.layers, plan.micro_batch_size)
    if data is not None:
        from pipeloom.models.workload import llama_workload

        if data.vocab_limit > config.vocab:
            raise ConfigError(
                f"data: token ids reach {data.vocab_limit - 1}, beyond the planned model's vocabulary of {config.vocab}"
            )

        work = llama_workload(config, options.get("seed", 0), plan.partition, data)
        return TrainSpec(schedule=plan.schedule, workload=work, dp=plan.dp, **options)
    return TrainSpec(schedule=plan.schedule, config=config, dp=plan.dp, layer_counts=plan.partition, **options)


def builds_its_own_model(plan: Plan) -> bool:
    """Whether `spec_from_plan` builds the plan's model without being given one: the Hugging Face
    directory its profile measured, or the built-in decoder for a small planned LLaMA."""
    source = plan.cost_model.get("model") or ""
    return source.startswith("hf:") or (plan.tp == 1 and _is_built_in(plan.model))


def _is_built_in(planned) -> bool:
    """A planned model the built-in decoder is: gated, dense, without GQA, under 0.5B parameters."""
    return planned.gated and not planned.num_experts and planned.kv_heads is None and planned.params <= 5e8


def train_plan(plan: Plan | str | Path, model: str | None = None, data=None, **options) -> list[RankResult]:
    """Train a plan on this machine, one forked process per rank (`run_local`); the ranks' results."""
    from pipeloom.runtime.local import run_local

    return run_local(spec_from_plan(plan, model, data, **options))


def last_pipeline_phases(results: list[RankResult]) -> list[dict[str, float]]:
    """Each step's phases (seconds) on the one of `results` (one replica's pipeline ranks) whose
    pipeline ended last: a plan's predicted pipeline is its schedule's makespan, and a rank done
    sooner waits out the difference in the step's loss all-reduce, which would read as its
    overhead. (The replicas' wait for each other stays in the gradient sync, where the
    prediction puts it.)"""
    ranks = [result.phase_seconds for result in results if result.phase_seconds]
    return [max(phases, key=lambda step: step["pipeline"]) for phases in zip(*ranks)]
