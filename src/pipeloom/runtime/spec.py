"""What a training run is (`TrainSpec`), what each rank returns (`RankResult`), and the checks
that refuse a run before any compute: invalid schedule, wrong world size, a model that cannot be
cut, a device, backend or dtype this machine cannot run."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.validate import validate
from pipeloom.models.llama import LlamaConfig, stage_layer_counts
from pipeloom.models.workload import Workload, llama_workload
from pipeloom.runtime.checkpoint import find_checkpoint
from pipeloom.runtime.layout import RankLayout
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.step_state import StepRecord

__all__ = [
    "CheckpointPart",
    "ModelPart",
    "OptimizerPart",
    "ParallelPart",
    "RankResult",
    "TrainSpec",
    "check_device",
    "check_spec",
]


# A run in parts: each piece of the runtime takes the part it needs, not the whole TrainSpec.
# TrainSpec keeps its flat fields (the public constructor) and hands out these views.


@dataclass(frozen=True)
class ModelPart:
    """What is trained: the model, its data and loss, and how much of it a checkpoint recomputes."""

    config: LlamaConfig
    seed: int
    layer_counts: tuple[int, ...] | None
    workload: Workload | None
    recompute_layers: int | None

    def resolved(self) -> Workload:
        return self.workload or llama_workload(self.config, self.seed, self.layer_counts)


@dataclass(frozen=True)
class ParallelPart:
    """Where it runs: the pipeline schedule, data-parallel replicas, static-memory sharding and
    offload, and the devices and backend of the ranks."""

    schedule: Schedule
    dp: int
    zero: int
    offload_stages: tuple[int, ...]
    reload_bits: int
    concat_w: bool
    threads: int
    timeout_s: float
    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1

    @property
    def layout(self) -> RankLayout:
        return RankLayout(self.schedule.num_devices, self.dp, self.tp)


@dataclass(frozen=True)
class OptimizerPart:
    """How a step updates the weights: AdamW's rate, the precision, global clipping,
    post-validation and fp16's loss scale."""

    lr: float
    dtype: str
    clip_norm: float | None
    post_validation: bool
    initial_loss_scale: float
    loss_scale_growth_interval: int

    @property
    def needs_global_state(self) -> bool:
        """Whether a step waits on every stage's gradients (clipping, skipping, fp16's overflow)."""
        return self.clip_norm is not None or self.post_validation or self.dtype == "fp16"


@dataclass(frozen=True)
class CheckpointPart:
    every: int
    directory: str | None
    resume_from: str | None


@dataclass(frozen=True)
class TrainSpec:
    schedule: Schedule
    config: LlamaConfig = LlamaConfig()
    dp: int = 1
    steps: int = 2
    seed: int = 0
    lr: float = 1e-3
    layer_counts: tuple[int, ...] | None = None
    concat_w: bool = False
    threads: int = 1
    timeout_s: float = 60.0
    report: bool = False
    """Rank 0 shows each step's loss, time, tokens/s, TFLOP/s and MFU as it goes."""
    backend: str | None = None
    """gloo (CPU) or nccl (GPUs); None: the device's natural one."""
    device: str | None = None
    """cpu or cuda (rank → LOCAL_RANK's GPU); None: cuda if the backend is nccl, else cpu."""
    dtype: str = "fp32"
    """Compute and p2p type: fp32, bf16 or fp16 (with a dynamic loss scale); master weights,
    AdamW state and the gradient reduction stay fp32."""
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    peak_tflops: float | None = None
    """Per-rank peak of the compute type, for MFU; None leaves MFU out."""
    record_gradients: bool = False
    """Keep the last step's reduced gradients in the result (for tests against the reference)."""
    workload: Workload | None = None
    """Any model, data and loss; None: the LLaMA-style decoder of `config`."""
    zero: int = 0
    """Static memory (`pipeloom.runtime.zero`): 0 keeps fp32 weights and the whole AdamW state on
    every replica; 1 keeps the weights in the compute type and shards the fp32 master weights and
    AdamW over the data-parallel replicas; 2 also reduce-scatters the gradients."""
    recompute_layers: int | None = None
    """Partial checkpoint (Megatron's --recompute-num-layers, block method): a checkpointed
    forward drops only the activations of its stage's first k layers; None: the whole stage's."""
    offload_stages: tuple[int, ...] = ()
    """T-Offload: these stages' optimizer runs on the host (`runtime.offload`)."""
    reload_bits: int = 32
    """Weights come back exactly (32) or rounded through bfloat16 (16)."""
    clip_norm: float | None = None
    """Clip gradients to this global norm (over every stage); a step with NaN/Inf gradients is
    skipped whenever clipping or post-validation is on."""
    post_validation: bool = False
    """Step under a partially reduced state and validate afterwards (Zero Bubble §4) instead of
    all-reducing it first."""
    gradient_faults: tuple[tuple[int, int, str, float], ...] = ()
    """For tests of the above: (step, stage, "nan" or "scale", factor) applied to that stage's
    gradients after they are reduced."""
    save_every: int = 0
    """Write a checkpoint every this many steps into `save_dir` (0: never)."""
    save_dir: str | None = None
    resume_dir: str | None = None
    """Continue from a checkpoint (a step-N directory, or the newest in this directory) up to `steps`."""
    tp: int = 1
    """Tensor-parallel ranks per pipeline device (`runtime.tensor_parallel`): the world is p × dp × tp."""
    sequence_parallel: bool = False
    """With tp > 1: norms and residuals on sequence shards (all-gather / reduce-scatter)."""
    ep: int = 1
    """Expert-parallel ranks (`runtime.expert_parallel`): each MoE layer's routed experts shared
    out over groups of `ep` data-parallel replicas of a stage; ep divides dp."""

    def resolved_workload(self) -> Workload:
        return self.model.resolved()

    @property
    def model(self) -> ModelPart:
        return ModelPart(self.config, self.seed, self.layer_counts, self.workload, self.recompute_layers)

    @property
    def parallelism(self) -> ParallelPart:
        return ParallelPart(
            self.schedule,
            self.dp,
            self.zero,
            self.offload_stages,
            self.reload_bits,
            self.concat_w,
            self.threads,
            self.timeout_s,
            self.tp,
            self.sequence_parallel,
            self.ep,
        )

    @property
    def optimizer(self) -> OptimizerPart:
        return OptimizerPart(
            self.lr,
            self.dtype,
            self.clip_norm,
            self.post_validation,
            self.initial_loss_scale,
            self.loss_scale_growth_interval,
        )

    @property
    def checkpoints(self) -> CheckpointPart:
        return CheckpointPart(self.save_every, self.save_dir, self.resume_dir)

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
    offload_events: list[tuple[str, float, float]] = field(default_factory=list)
    """T-Offload's OFFLOAD, HOST_STEP and RELOAD on this rank (perf_counter seconds)."""
    all_results: list | None = None
    """On rank 0 of a gathered run: every rank's result."""


def check_spec(spec: TrainSpec, world_size: int | None = None) -> None:
    """Refuse before any compute: invalid schedule, wrong world size, uncuttable layers — part by part."""
    parallel = spec.parallelism
    validate(parallel.schedule)
    _check_parallelism(parallel, world_size)
    if parallel.zero and spec.record_gradients:
        raise ConfigError("train: ZeRO keeps only a shard of the reduced gradients; record them with --zero 0")
    check_device(spec)
    _check_optimizer(spec.optimizer, parallel)
    _check_model(spec.model, parallel.schedule)
    _check_tensor_parallel(spec.model, parallel)
    _check_expert_parallel(spec, parallel)
    _check_checkpoints(spec.checkpoints, parallel, spec.steps)


def _check_parallelism(parallel: ParallelPart, world_size: int | None) -> None:
    schedule = parallel.schedule
    if parallel.dp < 1:
        raise ConfigError(f"train: data-parallel size must be at least 1, got {parallel.dp}")
    if parallel.zero not in (0, 1, 2):
        raise ConfigError(f"train: the ZeRO level must be 0, 1 or 2, got {parallel.zero!r}")
    if not isinstance(parallel.tp, int) or parallel.tp < 1:
        raise ConfigError(f"train: --tp must be a positive number of ranks, got {parallel.tp!r}")
    if parallel.sequence_parallel and parallel.tp == 1:
        raise ConfigError(
            "train: --sequence-parallel shards the sequence over a tensor-parallel group; add --tp N (N > 1)"
        )
    expected = parallel.layout.world_size
    if world_size is not None and world_size != expected:
        raise ConfigError(
            f"train: world size {world_size} does not match p × dp × tp = {schedule.num_devices} × {parallel.dp} × "
            f"{parallel.tp} = {expected}"
        )
    bad = sorted(set(parallel.offload_stages) - set(range(schedule.num_stages)))
    if bad or parallel.reload_bits not in (16, 32):
        raise ConfigError(
            f"train: offload stages must be among the schedule's and reload bits 16 or 32 (got {bad}, {parallel.reload_bits})"
        )


def _check_optimizer(optimizer: OptimizerPart, parallel: ParallelPart) -> None:
    Precision(optimizer.dtype)
    if parallel.tp > 1 and optimizer.needs_global_state:
        raise ConfigError(
            "train: --tp does not yet combine with --clip-norm, --post-validation or fp16's overflow skip "
            "(their global norm would have to sum the tensor-parallel shards); use bf16 without them"
        )
    if optimizer.dtype == "fp16" and parallel.offload_stages:
        raise ConfigError("train: fp16's loss scale does not cover host-stepped (offloaded) stages; use bf16")
    if optimizer.clip_norm is not None and optimizer.clip_norm <= 0:
        raise ConfigError(f"train: the clipping norm must be positive, got {optimizer.clip_norm}")


def _check_model(model: ModelPart, schedule: Schedule) -> None:
    slices = schedule.num_slices
    seq_len = model.workload.sample_tokens if model.workload is not None else model.config.seq_len
    if slices > 1 and seq_len % slices:
        raise ConfigError(f"train: sequence length {seq_len} does not split into {slices} equal slices")
    if model.workload is None:
        stage_layer_counts(model.config, schedule.num_stages, model.layer_counts)
    elif model.workload.check is not None:
        model.workload.check(schedule.num_stages)
    _check_recompute_layers(model.recompute_layers, schedule)


def _check_tensor_parallel(model: ModelPart, parallel: ParallelPart) -> None:
    """A model that can be cut over `tp` ranks: its own plan says so, and the sequence splits."""
    if parallel.tp == 1:
        return
    if parallel.schedule.num_slices > 1:
        raise ConfigError("train: slices (svpp, terapipe) do not combine with --tp yet; use a schedule without slices")
    work = model.resolved()
    if work.tensor_parallel is None:
        raise ConfigError(f"train: {work.name} has no tensor-parallel plan; use --tp 1")
    work.tensor_parallel(parallel.tp, parallel.sequence_parallel)  # raises when heads, columns or vocab do not divide
    if work.sample_tokens % parallel.tp:
        raise ConfigError(
            f"train: sequence length {work.sample_tokens} does not split into {parallel.tp} equal shards "
            "(each tensor-parallel rank sends its shard between stages)"
        )


def _check_expert_parallel(spec: TrainSpec, parallel: ParallelPart) -> None:
    """Experts that split evenly over groups of data-parallel replicas, and the features that do
    not combine with expert shards yet, refused in one line each."""
    ep = parallel.ep
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ConfigError(f"train: --ep must be a positive number of ranks, got {ep!r}")
    if ep == 1:
        return
    if parallel.dp % ep:
        raise ConfigError(
            f"train: --ep {ep} does not divide --dp {parallel.dp} (an expert-parallel group is made of "
            "data-parallel replicas of one stage)"
        )
    experts = spec.model.resolved().experts
    if experts is None:
        raise ConfigError(
            f"train: {spec.model.resolved().name} has no routed experts; --ep needs a mixture-of-experts model "
            "(mixtral, qwen2_moe, qwen3_moe)"
        )
    if experts.num_experts % ep:
        raise ConfigError(f"train: the model's {experts.num_experts} experts do not divide by --ep {ep}")
    refused = {
        "--tp": parallel.tp > 1,
        "--zero": parallel.zero > 0,
        "--offload": bool(parallel.offload_stages),
        "--clip-norm, --post-validation or fp16": spec.optimizer.needs_global_state,
        "--save or --resume": spec.checkpoints.directory is not None or spec.checkpoints.resume_from is not None,
    }
    for flag, asked in refused.items():
        if asked:
            raise ConfigError(f"train: --ep does not combine with {flag} yet (the expert shards have their own groups)")


def _check_checkpoints(checkpoints: CheckpointPart, parallel: ParallelPart, steps: int) -> None:
    if (checkpoints.directory is None) != (checkpoints.every == 0) or checkpoints.every < 0:
        raise ConfigError("train: checkpoints need both a directory (--save) and a period (--save-every >= 1)")
    if checkpoints.resume_from is not None:
        schedule = parallel.schedule
        _, done = find_checkpoint(
            checkpoints.resume_from,
            parallel.layout.world_size,
            schedule.name,
            parallel.zero,
            parallel.offload_stages,
            parallel.tp,
        )
        if done >= steps:
            raise ConfigError(f"train: the checkpoint is already {done} steps in; ask for more than {done} --steps")


def _check_recompute_layers(k: int | None, schedule: Schedule) -> None:
    if k is None:
        return
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"train: --recompute-layers must be a positive number of layers, got {k!r}")
    if not any(op.ckpt for _, _, op in schedule.ops()):
        raise ConfigError(
            "train: --recompute-layers sets how much of each checkpoint to recompute, but the schedule "
            "checkpoints nothing; add --ckpt full or mario"
        )
    if schedule.num_slices > 1:
        raise ConfigError("train: --recompute-layers checkpoints whole micro-batches; it does not run slice by slice")


def check_device(spec: TrainSpec) -> None:
    """Backend, device and dtype that this machine can run."""
    device, backend = spec.torch_device_type, spec.resolved_backend
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"train: device must be cpu or cuda, got {device!r}")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"train: backend must be gloo or nccl, got {backend!r}")
    if (device, backend) not in (("cpu", "gloo"), ("cuda", "nccl")):
        raise ConfigError(
            f"train: the {backend} backend does not carry {device} tensors here; use cpu+gloo or cuda+nccl"
        )
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train: --device cuda, but this machine has no CUDA GPU (torch sees none); use --device cpu")
    if device == "cuda" and spec.dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise ConfigError("train: this GPU does not support bf16; use --dtype fp16 or fp32")
    if device == "cpu" and spec.dtype != "fp32":
        probe = torch.ones(2, 2)
        try:
            with torch.autocast("cpu", dtype=Precision(spec.dtype).dtype):
                probe @ probe
        except RuntimeError:
            raise ConfigError(
                f"train: this torch build cannot compute in {spec.dtype} on CPU; use fp32 or bf16"
            ) from None
