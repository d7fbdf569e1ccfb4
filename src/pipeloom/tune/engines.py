"""A tuned plan in the settings of an engine that runs it: torchtitan's job config, Megatron-LM's
arguments.

torchtitan (0.3.0's field names) runs a schedule from torch's compute-only CSV
(`parallelism.pipeline_parallel_schedule_csv`, loaded by `_PipelineScheduleRuntime`), but it
builds each rank's stage modules by the *name* in `pipeline_parallel_schedule`: the v placement
for ZBVZeroBubble and DualPipeV, the loop placement for every other name. The name written here
is therefore one whose placement is the CSV's (`ir.torch_csv.placement_of`); the CSV, not the
name, sets the order. The micro-batch count is `training.local_batch_size //
pipeline_parallel_microbatch_size`, and an uneven partition needs `module_fqns_per_model_part`
(torchtitan's LLaMA names: `tok_embeddings`, `layers.N`, `norm`, `lm_head`). What the plan does
that torchtitan will not is said beside the settings, not dropped silently.

Megatron-LM (Core ≥ 0.13) takes the partition as `--pipeline-model-parallel-layout` (E the
embedding, t a decoder layer, L the loss, | between stages, stages in layer order: stage k on
pipeline rank k mod pp, virtual stage k div pp — the loop placement; the virtual pipeline size
follows from the number of stages). It runs its own 1F1B or interleaved 1F1B on that partition, so a
plan's zero-bubble order, W split or pairs are not carried, and a plan in the v placement is
refused: Megatron would put its stages elsewhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from pipeloom.errors import ConfigError
from pipeloom.ir.ops import OpKind
from pipeloom.ir.torch_csv import placement_of
from pipeloom.tune.partition import layout_string
from pipeloom.tune.plan import Plan

__all__ = ["MegatronSettings", "TorchtitanSettings", "megatron_settings", "torchtitan_settings"]


@dataclass(frozen=True)
class TorchtitanSettings:
    """torchtitan's `[parallelism]` and `[training]` fields for one plan, and what it leaves out."""

    pipeline_parallel_schedule: str
    placement: str
    pipeline_parallel_degree: int
    pipeline_parallel_microbatch_size: int
    module_fqns_per_model_part: tuple[tuple[str, ...], ...]
    tensor_parallel_degree: int
    enable_sequence_parallel: bool
    data_parallel_replicate_degree: int
    local_batch_size: int
    global_batch_size: int
    left_out: tuple[str, ...]
    """What of the plan torchtitan will not do, one sentence each."""
    context_parallel_degree: int = 1
    """Each sequence over this many ranks (torchtitan's own context parallelism: ring attention
    with the head-tail load balance, where pipeloom all-gathers keys and values)."""

    def to_toml(self, schedule_csv: str) -> str:
        """The job config fragment: TOML tables torchtitan's config manager reads."""
        parallelism = {
            "pipeline_parallel_degree": self.pipeline_parallel_degree,
            "pipeline_parallel_schedule": self.pipeline_parallel_schedule,
            "pipeline_parallel_schedule_csv": schedule_csv,
            "pipeline_parallel_microbatch_size": self.pipeline_parallel_microbatch_size,
            "module_fqns_per_model_part": [list(part) for part in self.module_fqns_per_model_part],
            "tensor_parallel_degree": self.tensor_parallel_degree,
            "enable_sequence_parallel": self.enable_sequence_parallel,
            "context_parallel_degree": self.context_parallel_degree,
            "data_parallel_replicate_degree": self.data_parallel_replicate_degree,
            "data_parallel_shard_degree": 1,
        }
        training = {"local_batch_size": self.local_batch_size, "global_batch_size": self.global_batch_size}
        lines = [
            "# torchtitan job config fragment written by `pipeloom export-plan --for torchtitan` (torchtitan 0.3.0).",
            f"# pipeline_parallel_schedule names the {self.placement} placement torchtitan builds stages in;",
            "# the CSV sets the order of every forward and backward.",
            *(f"# not done by torchtitan: {line}" for line in self.left_out),
            "",
            "[parallelism]",
            *(f"{key} = {_toml(value)}" for key, value in parallelism.items()),
            "",
            "[training]",
            *(f"{key} = {_toml(value)}" for key, value in training.items()),
        ]
        return "\n".join(lines) + "\n"


def torchtitan_settings(plan: Plan) -> TorchtitanSettings:
    """torchtitan's settings for `plan` (ConfigError where its stages sit in no torch placement,
    e.g. a stage on two ranks)."""
    schedule = plan.schedule
    placement = placement_of(schedule)
    paired = any(op.overlap_next for ops in schedule.devices for op in ops)
    one_stage_a_rank = schedule.num_stages == schedule.num_devices
    if placement == "v":
        name = "DualPipeV" if paired else "ZBVZeroBubble"
    elif one_stage_a_rank:
        name = "GPipe" if plan.scheme == "gpipe" else "1F1B"
    else:
        has_w = any(op.kind is OpKind.W for ops in schedule.devices for op in ops)
        name = "InterleavedZeroBubble" if has_w else "Interleaved1F1B"
    left_out = []
    if paired:
        left_out.append("overlapped F&B pairs run back to back in its eager runtime (nothing hides the all-to-all)")
    if plan.zero:
        left_out.append(
            f"pipeloom's ZeRO-{plan.zero} (optimizer state sharded over dp) has no match; data_parallel_shard_degree = "
            f"{plan.dp} instead of replicate would shard the weights too (FSDP)"
        )
    if plan.offload_stages:
        left_out.append(f"the host offload of stages {list(plan.offload_stages)} has no torchtitan setting")
    return TorchtitanSettings(
        pipeline_parallel_schedule=name,
        placement=placement,
        pipeline_parallel_degree=schedule.num_devices,
        pipeline_parallel_microbatch_size=plan.micro_batch_size,
        module_fqns_per_model_part=_module_fqns(plan.partition),
        tensor_parallel_degree=plan.tp,
        enable_sequence_parallel=plan.sequence_parallel,
        data_parallel_replicate_degree=plan.dp,
        local_batch_size=plan.micro_batch_size * schedule.num_microbatches,
        global_batch_size=plan.global_batch,
        left_out=tuple(left_out),
        context_parallel_degree=plan.cp,
    )


@dataclass(frozen=True)
class MegatronSettings:
    """Megatron-LM's command-line arguments for one plan, and what of the plan they leave out."""

    arguments: tuple[str, ...]
    left_out: tuple[str, ...]


def megatron_settings(plan: Plan) -> MegatronSettings:
    """Megatron-LM's arguments for `plan`; ConfigError for a plan Megatron would place otherwise
    (the v placement, a stage on two ranks) or cannot cut (slices)."""
    schedule = plan.schedule
    if schedule.num_slices > 1:
        raise ConfigError(f"{schedule.name!r} cuts the sequence into slices, which Megatron-LM's pipeline cannot run")
    placement = placement_of(schedule)
    if placement != "loop":
        raise ConfigError(
            f"{schedule.name!r} sits in the {placement} placement; Megatron-LM's virtual stages sit in the loop "
            "placement (stage k on rank k mod pp): export an interleaved or 1f1b plan (tune --schemes interleaved,1f1b)"
        )
    ops = [op for device in schedule.devices for op in device]
    arguments = [
        *("--tensor-model-parallel-size", str(plan.tp)),
        *(["--sequence-parallel"] if plan.sequence_parallel and plan.tp > 1 else []),
        *(["--context-parallel-size", str(plan.cp)] if plan.cp > 1 else []),
        *("--pipeline-model-parallel-size", str(plan.pp)),
        *("--pipeline-model-parallel-layout", layout_string(plan.partition)),
        *("--micro-batch-size", str(plan.micro_batch_size)),
        *("--global-batch-size", str(plan.global_batch)),
    ]
    if plan.model.num_experts and plan.model.expert_parallel > 1:
        arguments += ["--expert-model-parallel-size", str(plan.model.expert_parallel)]
    if plan.zero:
        arguments.append("--use-distributed-optimizer")
    left_out = []
    if any(op.kind is OpKind.W or op.overlap_next for op in ops):
        left_out.append(
            f"{schedule.name}'s order (its split backward, W placement or pairs): Megatron runs its own 1F1B"
        )
    if any(op.ckpt for op in ops):
        arguments += ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
        left_out.append("recompute of the plan's chosen micro-batches only: Megatron recomputes every micro-batch")
    if plan.zero == 1:
        left_out.append("ZeRO-1 alone: Megatron's distributed optimizer also reduce-scatters the gradients (ZeRO-2)")
    if plan.offload_stages:
        left_out.append(f"the host offload of stages {list(plan.offload_stages)}")
    return MegatronSettings(tuple(arguments), tuple(left_out))


def _module_fqns(partition: tuple[int, ...]) -> tuple[tuple[str, ...], ...]:
    """Each stage's modules by torchtitan's LLaMA names: its layers, the embedding first, the
    final norm and head last.

    >>> _module_fqns((1, 2))
    (('tok_embeddings', 'layers.0'), ('layers.1', 'layers.2', 'norm', 'lm_head'))
    """
    parts, first = [], 0
    for stage, count in enumerate(partition):
        names = [f"layers.{layer}" for layer in range(first, first + count)]
        if stage == 0:
            names.insert(0, "tok_embeddings")
        if stage == len(partition) - 1:
            names += ["norm", "lm_head"]
        parts.append(tuple(names))
        first += count
    return tuple(parts)


def _toml(value: object) -> str:
    """A TOML value: JSON's spelling of strings, numbers and arrays is TOML's; booleans are lower case."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value, ensure_ascii=False)
