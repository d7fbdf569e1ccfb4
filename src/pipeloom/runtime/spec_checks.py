"""The checks that refuse a run before any compute, part by part of its `TrainSpec`: an invalid
schedule, a wrong world size, a model that cannot be cut (over its stages, its tensor-parallel
group, its experts), a device, backend or dtype this machine cannot run."""

from __future__ import annotations

import math

import torch

from pipeloom.data import check_seed
from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.validate import validate
from pipeloom.models.llama import stage_layer_counts
from pipeloom.runtime.checkpoint import find_checkpoint
from pipeloom.runtime.lr_schedule import LRCurve, resumed_curve
from pipeloom.runtime.precision import Precision
from pipeloom.runtime.spec import CheckpointPart, ModelPart, OptimizerPart, ParallelPart, TrainSpec
from pipeloom.runtime.tensor_parallel_styles import packs_projections

__all__ = ["check_device", "check_spec"]


def check_spec(spec: TrainSpec, world_size: int | None = None, on_this_device: bool = True) -> None:
    """Refuse before any compute: invalid schedule, wrong world size, uncuttable layers — part by
    part. `on_this_device=False`: leave what only a GPU itself can answer (whether it computes in
    bf16) to the ranks — a launcher that spawns GPU ranks must not start CUDA in its own process."""
    parallel = spec.parallelism
    if not isinstance(spec.steps, int) or isinstance(spec.steps, bool) or spec.steps < 1:
        raise ConfigError(f"train: steps must be an integer of at least 1, got {spec.steps!r}")  # 0 trained nothing
    check_seed(spec.seed)
    validate(parallel.schedule)
    _check_parallelism(parallel, world_size)
    if spec.compile and (parallel.tp > 1 or parallel.ep > 1 or parallel.cp > 1):
        raise ConfigError(
            "train: --compile does not yet combine with --tp, --cp or --ep (DTensor shards and gathers, the "
            "experts' host-sized exchanges); run those eager"
        )
    if parallel.zero and spec.record_gradients:
        raise ConfigError("train: ZeRO keeps only a shard of the reduced gradients; record them with --zero 0")
    check_device(spec, on_this_device)
    _check_optimizer(spec.optimizer, parallel)
    spec.optimizer.schedule.check(spec.lr, spec.steps)
    if spec.optimizer.schedule.varies and spec.post_validation:
        raise ConfigError(
            "train: --post-validation redoes a rolled-back step at the rate it ran with; use it with a constant "
            "--lr-schedule and no warm-up"
        )
    _check_evaluation(spec)
    _check_model(spec.model, parallel.schedule)
    _check_tensor_parallel(spec.model, parallel)
    _check_expert_parallel(spec, parallel)
    _check_context_parallel(spec, parallel)
    work = spec.resolved_workload()
    packed = packs_projections(work, parallel.tp, parallel.sequence_parallel)
    _check_checkpoints(spec.checkpoints, parallel, spec.optimizer, spec.steps, (work.data, spec.dtype), packed)


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
    if not isinstance(parallel.cp, int) or parallel.cp < 1:
        raise ConfigError(f"train: --cp must be a positive number of ranks, got {parallel.cp!r}")
    expected = parallel.layout.world_size
    if world_size is not None and world_size != expected:
        cp = f" × {parallel.cp}" if parallel.cp > 1 else ""
        raise ConfigError(
            f"train: world size {world_size} does not match p × dp{' × cp' if cp else ''} × tp = "
            f"{schedule.num_devices} × {parallel.dp}{cp} × {parallel.tp} = {expected}"
        )
    bad = sorted(set(parallel.offload_stages) - set(range(schedule.num_stages)))
    if bad or parallel.reload_bits not in (16, 32):
        raise ConfigError(
            f"train: offload stages must be among the schedule's and reload bits 16 or 32 (got {bad}, {parallel.reload_bits})"
        )


def _check_context_parallel(spec: TrainSpec, parallel: ParallelPart) -> None:
    """A sequence split over cp ranks needs a model whose attention can gather it back (rotary
    positions, causal attention: `Workload.context_parallel`), an even head-tail cut, and whole
    micro-batches: slices cut the sequence along the same dimension (SVPP and TeraPipe pipeline
    what context parallelism spreads), so the two are not combined."""
    cp = parallel.cp
    if cp == 1:
        return
    work = spec.resolved_workload()
    if work.context_parallel is None:
        raise ConfigError(
            f"train: --cp {cp}: {work.name} cannot split its sequence over ranks (context parallelism needs causal "
            "attention over rotary positions and a loss of each token's own: the Hugging Face LLaMA, Mistral and "
            "Qwen2 families, and their mixtures of experts without the load-balancing loss, a function of every "
            "token's routing)"
        )
    if work.sample_tokens % (2 * cp):
        raise ConfigError(
            f"train: --cp {cp}: the sequence of {work.sample_tokens} tokens does not cut into {2 * cp} equal chunks "
            "(two per rank, head and tail); choose --seq-len as a multiple of that"
        )
    if parallel.schedule.num_slices > 1:
        raise ConfigError(
            f"train: --cp {cp} with a sliced schedule: slices and context parallelism both cut the sequence; use one"
        )
    if parallel.sequence_parallel and (work.sample_tokens // cp) % parallel.tp:
        raise ConfigError(
            f"train: --cp {cp} with --sequence-parallel: a rank's {work.sample_tokens // cp} tokens do not cut into "
            f"{parallel.tp} sequence shards"
        )


def _check_optimizer(optimizer: OptimizerPart, parallel: ParallelPart) -> None:
    Precision(optimizer.dtype)
    lr = optimizer.lr
    if not (isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0):
        raise ConfigError(f"train: the learning rate must be a positive finite number, got {lr!r}")
    clip = optimizer.clip_norm
    if clip is not None and not (math.isfinite(clip) and clip > 0):
        raise ConfigError(f"train: the clipping norm must be positive, got {clip}")


def _check_evaluation(spec: TrainSpec) -> None:
    for name, value, least in (("--eval-every", spec.eval_every, 0), ("--eval-batches", spec.eval_batches, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ConfigError(f"train: {name} must be an integer of at least {least}, got {value!r}")
    if spec.eval_every and spec.eval_data is None:
        raise ConfigError("train: --eval-every needs held-out data: add --eval-data PATH")
    if spec.eval_data is not None and not callable(spec.eval_data):  # it failed only at the first evaluation
        raise ConfigError(
            f"train: eval_data must be a batch function, (rows, batch index) → inputs and targets, such as "
            f"open_tokens(...).batch; got a {type(spec.eval_data).__name__}"
        )


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
    if parallel.replicas % ep:
        replicas = f"--dp {parallel.dp}" if parallel.cp == 1 else f"--dp × --cp = {parallel.replicas}"
        raise ConfigError(
            f"train: --ep {ep} does not divide {replicas} (an expert-parallel group is made of "
            "data-parallel (and context-parallel) replicas of one stage)"
        )
    experts = spec.model.resolved().experts
    if experts is None:
        raise ConfigError(
            f"train: {spec.model.resolved().name} has no routed experts; --ep needs a mixture-of-experts model "
            "(mixtral, qwen2_moe, qwen3_moe)"
        )
    if experts.num_experts % ep:
        raise ConfigError(f"train: the model's {experts.num_experts} experts do not divide by --ep {ep}")


def _check_checkpoints(
    checkpoints: CheckpointPart,
    parallel: ParallelPart,
    optimizer: OptimizerPart,
    steps: int,
    inputs: tuple[dict | None, str],
    tp_packed: bool = False,
) -> None:
    if (checkpoints.directory is None) != (checkpoints.every == 0) or checkpoints.every < 0:
        raise ConfigError("train: checkpoints need both a directory (--save) and a period (--save-every >= 1)")
    if checkpoints.keep_last < 0 or (checkpoints.keep_last and checkpoints.directory is None):
        raise ConfigError(f"train: --keep-last K (K >= 1) applies to --save, got {checkpoints.keep_last}")
    if optimizer.lr_restart and checkpoints.resume_from is None:
        raise ConfigError("train: --lr-restart begins the schedule anew at a resumed step: it applies to --resume DIR")
    if checkpoints.resume_from is not None:
        schedule = parallel.schedule
        _, facts = find_checkpoint(
            checkpoints.resume_from,
            parallel.layout.world_size,
            schedule.name,
            parallel.zero,
            parallel.offload_stages,
            parallel.tp,
            layout_free=True,
            tp_packed=tp_packed,
        )
        done = int(facts["step"])
        if done >= steps:
            raise ConfigError(f"train: the checkpoint is already {done} steps in; ask for more than {done} --steps")
        resumed_curve(optimizer.curve(steps), LRCurve.from_record(facts.get("lr_curve")), done, optimizer.lr_restart)
        changes = input_changes(facts, *inputs)
        if changes and not checkpoints.allow_input_change:
            raise ConfigError(
                f"train: the checkpoint was trained on {'; and '.join(changes)}: give the same --data/--dtype to "
                "continue the run, or --allow-input-change to continue it on these"
            )


def input_changes(facts: dict, data: dict | None, dtype: str) -> list[str]:
    """How this run's data and compute type differ from what a checkpoint (its marker's `facts`)
    was trained on; checkpoints older than these records differ in nothing."""
    from pipeloom.provenance import differences

    changes = differences(facts.get("data"), data)
    recorded = facts.get("dtype")
    if recorded is not None and recorded != dtype:
        changes.append(f"{recorded} compute, not {dtype}")
    return changes


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


def check_device(spec: TrainSpec, on_this_device: bool = True) -> None:
    """Backend, device and dtype that this machine can run (`on_this_device`: also what only the
    device can say, which for a GPU starts CUDA in this process; whether torch sees a GPU at all
    it answers without)."""
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
    if device == "cuda" and spec.dtype == "bf16" and on_this_device and not torch.cuda.is_bf16_supported():
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
