"""What a training run is (`TrainSpec`) and what each rank returns (`RankResult`); the checks that
refuse a run before any compute live in `spec_checks`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch

from pipeloom.ir.schedule import Schedule
from pipeloom.models.llama import LlamaConfig
from pipeloom.models.workload import Workload, llama_workload
from pipeloom.runtime.layout import RankLayout
from pipeloom.runtime.lr_schedule import LRCurve, LRSchedule
from pipeloom.runtime.step_state import StepRecord

__all__ = [
    "CheckpointPart",
    "EvaluationPart",
    "FLAT",
    "LoggingPart",
    "ModelPart",
    "PARTS",
    "OptimizerPart",
    "ParallelPart",
    "RankResult",
    "TrainSpec",
]


# A run in parts, as torchtitan's job config is: each piece of the runtime takes the part it
# needs, the config file's tables are the same parts, and the flat keywords of the first
# TrainSpec still build one (`TrainSpec(schedule, dp=2, lr=1e-3)`, `replace(spec, tp=2)`,
# `spec.dp`).


@dataclass(frozen=True, kw_only=True)
class ModelPart:
    """What is trained: the model, its data and loss, and how much of it a checkpoint recomputes."""

    config: LlamaConfig = LlamaConfig()
    seed: int = 0
    layer_counts: tuple[int, ...] | None = None
    workload: Workload | None = None
    """Any model, data and loss; None: the LLaMA-style decoder of `config`."""
    recompute_layers: int | None = None
    """Partial checkpoint (Megatron's --recompute-num-layers, block method): a checkpointed
    forward drops only the activations of its stage's first k layers; None: the whole stage's."""

    def resolved(self) -> Workload:
        return self.workload or llama_workload(self.config, self.seed, self.layer_counts)


@dataclass(frozen=True, kw_only=True)
class ParallelPart:
    """Where and how it runs: the pipeline schedule, data-, context-, tensor- and expert-parallel sizes,
    static-memory sharding and offload, the devices and backend of the ranks, compilation."""

    schedule: Schedule
    dp: int = 1
    zero: int = 0
    """Static memory (`pipeloom.runtime.zero`): 0 keeps fp32 weights and the whole AdamW state on
    every replica; 1 keeps the weights in the compute type and shards the fp32 master weights and
    AdamW over the data-parallel replicas; 2 also reduce-scatters the gradients."""
    offload_stages: tuple[int, ...] = ()
    """T-Offload: these stages' optimizer runs on the host (`runtime.offload`)."""
    reload_bits: int = 32
    """Weights come back exactly (32) or rounded through bfloat16 (16)."""
    concat_w: bool = False
    threads: int = 1
    timeout_s: float = 60.0
    tp: int = 1
    """Tensor-parallel ranks per pipeline device (`runtime.tensor_parallel`): the world is p × dp × tp."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals on sequence shards (all-gather / reduce-scatter)."""
    ep: int = 1
    """Expert-parallel ranks (`runtime.expert_parallel`): each MoE layer's routed experts shared
    out over groups of `ep` data-parallel replicas of a stage; ep divides dp."""
    cp: int = 1
    """Context-parallel ranks per stage (`models.context_parallel`): each holds two opposite
    chunks of every sequence and gathers the others' keys and values; the world is p × dp × cp × tp."""
    overlap_grad_sync: bool = True
    """Start a stage's gradient all-reduce as soon as its last backward of the step on the rank
    ends, under the later stages' work (`runtime.gradients`); False: every bucket after the
    pipeline."""
    backend: str | None = None
    """gloo (CPU) or nccl (GPUs); None: the device's natural one."""
    device: str | None = None
    """cpu or cuda (rank → LOCAL_RANK's GPU); None: cuda if the backend is nccl, else cpu."""
    compile: bool = False
    """Run each stage, and the loss, under `torch.compile` (`runtime.compiled`)."""
    separate_w: bool = False
    """Run every W as its own GEMMs, also one right after its B (which otherwise folds into the
    B: nothing to fill there); the profiler sets it to time W apart."""

    @property
    def replicas(self) -> int:
        """Copies of each weight: the data-parallel replicas and, within each, its context-parallel
        ranks — what gradients are summed and ZeRO shards over."""
        return self.dp * self.cp

    @property
    def layout(self) -> RankLayout:
        return RankLayout(self.schedule.num_devices, self.replicas, self.tp, self.cp)


@dataclass(frozen=True, kw_only=True)
class OptimizerPart:
    """How a step updates the weights: AdamW's rate and its schedule, the precision, global
    clipping, post-validation and fp16's loss scale."""

    lr: float = 1e-3
    dtype: str = "fp32"
    """Compute and p2p type: fp32, bf16 or fp16 (with a dynamic loss scale); master weights,
    AdamW state and the gradient reduction stay fp32."""
    clip_norm: float | None = None
    """Clip gradients to this global norm (over every stage); a step with NaN/Inf gradients is
    skipped whenever clipping or post-validation is on."""
    post_validation: bool = False
    """Step under a partially reduced state and validate afterwards (Zero Bubble §4) instead of
    all-reducing it first."""
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    lr_schedule: str = "constant"
    """The learning rate over the run (`runtime.lr_schedule`): constant, linear or cosine decay
    to `min_lr` at the last step, after `warmup_steps` of linear warm-up."""
    warmup_steps: int = 0
    min_lr: float = 0.0
    gradient_faults: tuple[tuple[int, int, str, float], ...] = ()
    """For tests of the above: (step, stage, "nan" or "scale", factor) applied to that stage's
    gradients after they are reduced."""

    lr_restart: bool = False
    """On resume, begin the schedule anew at the resumed step (warm-up, then the decay over the
    steps left) instead of continuing the checkpoint's curve."""

    @property
    def schedule(self) -> LRSchedule:
        return LRSchedule(self.lr_schedule, self.warmup_steps, self.min_lr)

    def curve(self, steps: int) -> LRCurve:
        """The rate of every step of a fresh run of `steps` steps."""
        return LRCurve(self.lr, self.schedule, steps)

    @property
    def needs_global_state(self) -> bool:
        """Whether a step waits on every stage's gradients (clipping, skipping, fp16's overflow)."""
        return self.clip_norm is not None or self.post_validation or self.dtype == "fp16"


@dataclass(frozen=True, kw_only=True)
class CheckpointPart:
    every: int = 0
    """Write a checkpoint every this many steps into `directory` (0: never), and after the last step."""
    directory: str | None = None
    resume_from: str | None = None
    """Continue from a checkpoint (a step-N directory, or the newest in this directory) up to `steps`."""
    keep_last: int = 0
    """Keep only the newest this many checkpoints in `directory` (0: every one)."""
    allow_input_change: bool = False
    """Resume although the data or dtype differ from what the checkpoint was trained on."""
    force: bool = False
    """Start over in a checkpoint or log directory that holds another run's files, moving them
    aside first (`runtime.run_outputs`); without it such a run is refused."""


@dataclass(frozen=True, kw_only=True)
class EvaluationPart:
    data: Callable | None = None
    """(rows, batch index) → held-out inputs and targets (`runtime.evaluation`); None: no evaluation."""
    every: int = 0
    """Evaluate after every this many steps (0: never)."""
    batches: int = 1


@dataclass(frozen=True, kw_only=True)
class LoggingPart:
    """What a run shows, writes and hands back."""

    report: bool = False
    """Rank 0 shows each step's loss, time, tokens/s, TFLOP/s and MFU as it goes."""
    peak_tflops: float | None = None
    """Per-rank peak of the compute type, for MFU; None leaves MFU out."""
    log_dir: str | None = None
    """Write TensorBoard events and metrics.jsonl here (`runtime.run_log`)."""
    wandb: str | None = None
    """Also log to this Weights & Biases project (offline unless WANDB_MODE says otherwise)."""
    run_config: dict | None = None
    """The effective configuration (flags, config file), kept in checkpoints, logs and summaries."""
    record_gradients: bool = False
    """Keep the last step's reduced gradients in the result (for tests against the reference)."""
    return_parameters: bool = True
    """Hand the final weights back in each rank's result, gathered whole over tensor- and expert-
    parallel groups (for tests and library callers); the CLI, which saves checkpoints instead,
    leaves them where they are."""


PARTS: dict[str, type] = {
    "model": ModelPart,
    "parallelism": ParallelPart,
    "optimizer": OptimizerPart,
    "checkpoints": CheckpointPart,
    "evaluation": EvaluationPart,
    "logging": LoggingPart,
}
"""TrainSpec's parts by name: what the config file's tables are called."""

_RENAMED = {
    "save_every": ("checkpoints", "every"),
    "save_dir": ("checkpoints", "directory"),
    "resume_dir": ("checkpoints", "resume_from"),
    "eval_data": ("evaluation", "data"),
    "eval_every": ("evaluation", "every"),
    "eval_batches": ("evaluation", "batches"),
}
FLAT: dict[str, tuple[str, str]] = {
    **{
        f.name: (part, f.name)
        for part, kind in PARTS.items()
        for f in fields(kind)
        if (part, f.name) not in _RENAMED.values()
    },
    **_RENAMED,
}
"""A flat keyword of TrainSpec → (its part, the field there): the field's own name, but for the
checkpoint and evaluation fields, which keep the names they had as flags (save_dir, eval_every)."""


@dataclass(frozen=True, init=False)
class TrainSpec:
    """A training run: its parts (`model`, `parallelism`, `optimizer`, `checkpoints`,
    `evaluation`, `logging`) and its length. Built from parts, from the flat keywords of each
    part's fields (`FLAT`: `dp=2`, `lr=1e-3`, `save_dir=...`), or both — a flat keyword wins over
    the part it belongs to, so `dataclasses.replace(spec, tp=2)` changes one field. A flat name
    reads through (`spec.dp` is `spec.parallelism.dp`)."""

    parallelism: ParallelPart
    model: ModelPart
    optimizer: OptimizerPart
    checkpoints: CheckpointPart
    evaluation: EvaluationPart
    logging: LoggingPart
    steps: int

    def __init__(
        self,
        schedule: Schedule | None = None,
        *,
        steps: int = 2,
        parallelism: ParallelPart | None = None,
        model: ModelPart | None = None,
        optimizer: OptimizerPart | None = None,
        checkpoints: CheckpointPart | None = None,
        evaluation: EvaluationPart | None = None,
        logging: LoggingPart | None = None,
        **flat: Any,
    ) -> None:
        unknown = sorted(set(flat) - set(FLAT))
        if unknown:
            raise TypeError(f"TrainSpec got unexpected keyword(s) {', '.join(unknown)}")
        if schedule is not None:
            flat["schedule"] = schedule
        given = {
            "parallelism": parallelism,
            "model": model,
            "optimizer": optimizer,
            "checkpoints": checkpoints,
            "evaluation": evaluation,
            "logging": logging,
        }
        for name, kind in PARTS.items():
            changes = {FLAT[key][1]: value for key, value in flat.items() if FLAT[key][0] == name}
            part = given[name]
            if part is None:
                if name == "parallelism" and "schedule" not in changes:
                    raise TypeError("TrainSpec needs a schedule (or a parallelism part)")
                part = kind(**changes)
            elif changes:
                part = replace(part, **changes)
            object.__setattr__(self, name, part)
        object.__setattr__(self, "steps", steps)

    def __getattr__(self, name: str) -> Any:
        where = FLAT.get(name)
        if where is None or where[0] not in self.__dict__:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__dict__[where[0]], where[1])

    def changed(self, **flat: Any) -> TrainSpec:
        """This spec with some fields changed, by their flat names or whole parts (what
        `dataclasses.replace` does, typed for the flat names)."""
        return replace(self, **flat)

    @staticmethod
    def flat_names() -> list[str]:
        return sorted([*FLAT, "steps"])

    def resolved_workload(self) -> Workload:
        return self.model.resolved()

    @property
    def schedule(self) -> Schedule:
        return self.parallelism.schedule

    @property
    def torch_device_type(self) -> str:
        return self.device or ("cuda" if self.backend == "nccl" else "cpu")

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.torch_device_type == "cuda" else "gloo")


@dataclass
class RankResult:
    rank: int
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    phase_seconds: list[dict[str, float]] = field(default_factory=list)
    """Per step, where its time went: "pipeline" (the schedule's ops), "allreduce" (gradients
    over the replicas and between stages that share weights), "optimizer" (the step) and
    "overhead" (the rest: the batch, zeroing gradients, the loss all-reduce)."""
    records: list[StepRecord] = field(default_factory=list)
    parameters: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Stage → its parameters after the last step (this rank's copy)."""
    gradients: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """Stage → the gradients the last step's optimizer used, with `record_gradients`."""
    rollbacks: int = 0
    """Optimizer steps post-validation rolled back and redone."""
    grad_norms: list[float] = field(default_factory=list)
    """Each step's global gradient norm over every stage and shard, before clipping (NaN where a
    gradient was not finite) — where clipping, post-validation or fp16 reduce it; else empty."""
    skipped_steps: int = 0
    loss_scales: list[float] = field(default_factory=list)
    """fp16: the loss scale each step ran under."""
    forward_flops: float = 0.0
    """Model FLOPs of one forward of every micro-batch through this rank's stages in a step."""
    samples_per_step: int = 0
    """Samples (sequences, images) of a step over all replicas."""
    sample_tokens: int = 1
    peak_memory_bytes: int | None = None
    """torch.cuda.max_memory_allocated on this rank's GPU; None on CPU."""
    static_bytes: dict[str, int] = field(default_factory=dict)
    """Measured on this rank: weights, gradients, optimizer (device) and host bytes."""
    planned_static_bytes: dict[str, float] = field(default_factory=dict)
    """The same, as `pipeloom.static_memory` plans them for this rank's weights."""
    placements: list = field(default_factory=list)
    """Where each weight this rank holds lives (`placement.WeightPlacement`, by name): its whole
    and local shapes, its tensor- and expert-parallel placements, whether this rank counts it in
    the global norm, which optimizer keeps its state."""
    held_bytes: dict[str, int] = field(default_factory=dict)
    """Every tensor this rank's objects hold at the end, by what holds it (`census.HeldBytes`):
    its `parameters` are the static bytes as counted from the objects, stray copies included."""
    peak_host_bytes: int = 0
    """The rank process's peak resident memory (the kernel's high-water mark), bytes."""
    offload_events: list[tuple[str, float, float]] = field(default_factory=list)
    """T-Offload's OFFLOAD, HOST_STEP and RELOAD on this rank (perf_counter seconds)."""
    learning_rates: list[float | None] = field(default_factory=list)
    """The learning rate each step trained at (None: this rank steps no optimizer)."""
    eval_losses: list[tuple[int, float]] = field(default_factory=list)
    """(steps done, held-out loss) of each evaluation."""
    eval_seconds: list[float] = field(default_factory=list)
    """Wall time of each evaluation (all its batches)."""
    all_results: list | None = None
    """On rank 0 of a gathered run: every rank's result."""
