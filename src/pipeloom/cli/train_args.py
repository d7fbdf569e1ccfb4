"""The arguments `pipeloom train` and the torchrun entry point `python -m pipeloom.train` share,
and what the flags alone decide: their checks and the run's options. Torch is not imported here."""

from __future__ import annotations

import argparse
import math

from pipeloom.cli.args import add_ckpt, add_costs, add_schedule_source, int_list
from pipeloom.cli.model import add_model_arguments
from pipeloom.cli.output import check_outputs
from pipeloom.data import SEED_LIMIT
from pipeloom.errors import ConfigError
from pipeloom.files import check_directory_target
from pipeloom.profile.steadiness import WARMUP_STEPS

TIMED_PLAN_STEPS = 5
"""Steps `train --plan` times by default, after the warm-up: with fewer, a step's noise on a
busy machine (±5–10 %) is as large as the plan's error."""
PLAN_STEPS = WARMUP_STEPS + TIMED_PLAN_STEPS

__all__ = ["add_train_arguments", "add_run_arguments", "check_train_flags", "run_options", "steps_of"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments `pipeloom train` and `python -m pipeloom.train` share."""
    parser.add_argument(
        "--plan", metavar="PATH", help="run a plan written by `pipeloom tune` (schedule, model, dp, tp)"
    )
    add_schedule_source(parser)  # -m counts micro-batches per replica
    add_ckpt(parser)
    parser.add_argument(
        "--recompute-layers",
        type=int,
        metavar="K",
        help="with --ckpt: checkpoint only the first K layers of each checkpointed stage forward and keep the "
        "others' activations (Megatron's --recompute-num-layers; simulate it with recompute_fraction=K/layers)",
    )
    parser.add_argument(
        "--dp", type=int, default=1, action=_Given, help="data-parallel replicas (world size = p × dp × cp × tp)"
    )
    parser.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel ranks per pipeline device: attention heads, MLP columns and the vocabulary split "
        "Megatron-style (Hugging Face models; default 1, or the plan's)",
    )
    parser.add_argument(
        "--sequence-parallel",
        action="store_true",
        help="with --tp: norms and residuals on sequence shards (all-gather / reduce-scatter instead of all-reduce)",
    )
    parser.add_argument(
        "--cp",
        type=int,
        help="context-parallel ranks per pipeline device: each holds two opposite chunks of every sequence and "
        "gathers the others' keys and values (Hugging Face LLaMA, Mistral, Qwen2; default 1, or the plan's)",
    )
    parser.add_argument(
        "--ep",
        type=int,
        help="expert-parallel ranks: each MoE layer's routed experts shared out over groups of EP data-parallel "
        "replicas, tokens sent to their experts by all-to-all (EP divides --dp; default 1, or the plan's)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help=f"optimizer steps (default 3; with --plan {PLAN_STEPS}: {TIMED_PLAN_STEPS} timed after the warm-up, "
        "enough to tell the plan's error from the machine's noise)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the synthetic data")
    parser.add_argument(
        "--threads", type=int, default=1, action=_Given, help="torch threads per rank (default 1, or the plan's)"
    )
    parser.add_argument(
        "--lr", type=float, help="AdamW's peak learning rate (default 1e-3; with --resume, the checkpoint's)"
    )
    model = parser.add_argument_group("model (a small LLaMA-style decoder)")
    for flag, default, help_text in (
        ("--layers", 4, "decoder layers"),
        ("--hidden", 64, "hidden size"),
        ("--heads", 4, "attention heads"),
        ("--ffn", 128, "SwiGLU inner size"),
        ("--vocab", 128, "vocabulary size"),
        ("--seq-len", 32, "tokens per sequence"),
        ("--microbatch-size", 2, "sequences per micro-batch"),
    ):
        action = _Given if flag in ("--seq-len", "--microbatch-size") else "store"
        model.add_argument(flag, type=int, default=default, action=action, help=f"{help_text} (default {default})")
    model.add_argument("--layer-counts", metavar="N,N,..", help="decoder layers per stage (default: balanced)")
    add_costs(parser)
    parser.add_argument("--concat-w", action="store_true", help="run consecutive W of a stage as one GEMM (2BP)")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="run each stage and the loss under torch.compile (every schedule, W split included)",
    )
    parser.add_argument(
        "--no-overlap-grad-sync",
        dest="overlap_grad_sync",
        action="store_false",
        help="all-reduce the gradients after the pipeline instead of each stage's as its last backward ends",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for a peer before failing")
    add_model_arguments(parser)
    run = parser.add_argument_group("precision, devices, reporting")
    run.add_argument(
        "--dtype",
        choices=("fp32", "bf16", "fp16"),
        help="compute and p2p type (bf16/fp16 halve the p2p bytes); master weights and AdamW stay fp32; "
        "fp16 adds a dynamic loss scale (default fp32, or the type a --plan was profiled in)",
    )
    run.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="cpu (default) or cuda: rank r drives GPU LOCAL_RANK (--nproc spawns one rank per GPU)",
    )
    run.add_argument("--backend", choices=("gloo", "nccl"), help="default: nccl with --device cuda, gloo on CPU")
    run.add_argument(
        "--peak-tflops", type=float, metavar="X", help="per-rank peak TFLOP/s of the compute type, for MFU"
    )
    run.add_argument("--quiet", action="store_true", help="no live step line on stderr (it is off when not a terminal)")
    run.add_argument(
        "--hardware", metavar="NAME", help="a hardware preset (h100, a100-80g, ...) whose 16-bit peak gives MFU"
    )
    parser.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2),
        default=0,
        action=_Given,
        help="static memory: 0 fp32 weights and full AdamW on every replica (default); 1 weights in the "
        "compute type, fp32 master and AdamW sharded over --dp; 2 also reduce-scatters the gradients",
    )
    parser.add_argument(
        "--offload-stages",
        metavar="LIST",
        help="T-Offload: run these stages' optimizer on the host, off the compute thread",
    )
    parser.add_argument(
        "--reload-bf16", action="store_true", help="with --offload-stages: reload weights through bfloat16"
    )
    parser.add_argument(
        "--clip-norm", type=float, metavar="X", help="clip gradients to this global norm; skip NaN/Inf steps"
    )
    parser.add_argument(
        "--post-validation",
        action="store_true",
        help="step under the partially reduced norm and NaN state, validate and roll back later (Zero Bubble §4)",
    )
    parser.add_argument("--save", metavar="DIR", help="write checkpoints (torch.distributed.checkpoint) into DIR")
    parser.add_argument(
        "--save-every", type=int, default=0, metavar="K", help="with --save: every K steps, and after the last"
    )
    parser.add_argument(
        "--keep-last", type=int, default=0, metavar="K", help="with --save: keep only the newest K checkpoints"
    )
    parser.add_argument(
        "--resume",
        metavar="DIR",
        help="continue from the newest complete checkpoint in DIR (or a DIR/step-N) up to --steps",
    )
    parser.add_argument(
        "--allow-input-change",
        action="store_true",
        help="with --resume: continue although --data or --dtype differ from what the checkpoint was trained on",
    )
    parser.add_argument(
        "--force",
        action="store_true",
        help="start over in a --save or --log-dir that holds another run's files (moved to DIR.replaced-N first)",
    )
    add_run_arguments(parser)
    parser.add_argument("--trace", metavar="PATH", help="write a Chrome/Perfetto trace of every rank's ops")
    parser.add_argument("--summary", metavar="PATH", help="write a JSON summary: losses, step times, stash bytes")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """What makes a run one you would launch: a config file, the learning-rate curve, held-out
    evaluation and logs."""
    run = parser.add_argument_group("config, learning rate, evaluation, logs")
    run.add_argument(
        "--config",
        metavar="FILE",
        action="append",
        help='a TOML file of flags under their long names (schedule = "zb-h1", devices = 2, nproc = 2); '
        "flags on the command line override it, and a later --config an earlier one",
    )
    run.add_argument(
        "--lr-schedule",
        choices=("constant", "linear", "cosine"),
        help="the learning rate after warm-up: constant (default), or linear / cosine decay to --min-lr at the "
        "last step. With --resume, these four and --steps default to the checkpoint's; one given changes the "
        "curve from the resumed step on",
    )
    run.add_argument("--warmup-steps", type=int, metavar="N", help="linear warm-up over the first N steps (default 0)")
    run.add_argument("--min-lr", type=float, metavar="X", help="the decay's floor (default 0)")
    run.add_argument(
        "--lr-restart",
        action="store_true",
        help="with --resume: begin the schedule anew at the resumed step (warm-up, then the decay over the steps left)",
    )
    run.add_argument(
        "--eval-data",
        metavar="PATH",
        help="held-out data, in --data's formats: validation loss and perplexity, run as a forward-only pipeline",
    )
    run.add_argument(
        "--eval-every", type=int, metavar="N", help="with --eval-data: evaluate every N steps (default: after the last)"
    )
    run.add_argument(
        "--eval-batches",
        type=int,
        default=4,
        metavar="K",
        help="batches per evaluation, the same each time (default 4)",
    )
    run.add_argument(
        "--log-dir", metavar="DIR", help="write TensorBoard event files and metrics.jsonl (one line per step) into DIR"
    )
    run.add_argument(
        "--wandb",
        metavar="PROJECT",
        help="with --log-dir: also log to this Weights & Biases project (offline mode "
        "unless WANDB_MODE says otherwise)",
    )


class _Given(argparse.Action):
    """Stores the value and notes that the flag was given (`given`): `train --plan` refuses or
    notes a value other than its plan's, the flag's default value included."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, values)
        namespace.given = (*getattr(namespace, "given", ()), self.dest)


def check_train_flags(args: argparse.Namespace) -> None:
    """What the flags alone can be refused for, before torch is imported: counts, pairings,
    destinations, and a plan that does not hold together."""
    check_outputs([args.trace, args.summary], plot=None)
    check_directory_target(args.save, "--save")
    check_directory_target(args.log_dir, "--log-dir")
    _learning_rate_flags(args)
    args.steps = steps_of(args)
    for name in ("steps", "threads", "seq_len", "microbatch_size", "image_size"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not 0 <= args.seed < SEED_LIMIT:
        raise ConfigError(f"--seed must lie in [0, 2**32), got {args.seed}")
    if args.dp < 1:
        raise ConfigError(f"--dp must be at least 1, got {args.dp}")
    if args.tp is not None and args.tp < 1:
        raise ConfigError(f"--tp must be at least 1, got {args.tp}")
    if args.ep is not None and args.ep < 1:
        raise ConfigError(f"--ep must be at least 1, got {args.ep}")
    if args.cp is not None and args.cp < 1:
        raise ConfigError(f"--cp must be at least 1, got {args.cp}")
    if args.sequence_parallel and (args.tp or 1) < 2 and not args.plan:
        raise ConfigError("--sequence-parallel shards the sequence over a tensor-parallel group: add --tp N (N > 1)")
    nproc = getattr(args, "nproc", None)  # torchrun's entry point has none
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if bool(args.save) != bool(args.save_every):
        raise ConfigError("--save DIR and --save-every K go together")
    if args.save_every < 0:
        raise ConfigError(f"--save-every must be at least 1, got {args.save_every}")
    if args.allow_input_change and not args.resume:
        raise ConfigError("--allow-input-change applies to --resume DIR")
    if args.lr_restart and not args.resume:
        raise ConfigError("--lr-restart begins the schedule anew at a resumed step: it applies to --resume DIR")
    if args.reload_bf16 and not args.offload_stages:
        raise ConfigError("--reload-bf16 applies to --offload-stages")
    if args.eval_every is not None and not args.eval_data:
        raise ConfigError("--eval-every needs held-out data: add --eval-data PATH")
    if args.eval_every is not None and args.eval_every < 1:
        raise ConfigError(f"--eval-every must be at least 1, got {args.eval_every}")
    if args.eval_batches < 1:
        raise ConfigError(f"--eval-batches must be at least 1, got {args.eval_batches}")
    if args.wandb and not args.log_dir:
        raise ConfigError("--wandb logs beside --log-dir DIR: give --log-dir too")
    if not (math.isfinite(args.lr) and args.lr > 0):  # a NaN or an infinite rate trains to NaN
        raise ConfigError(f"--lr must be a positive finite number, got {args.lr}")
    if args.clip_norm is not None and not (math.isfinite(args.clip_norm) and args.clip_norm > 0):
        raise ConfigError(f"--clip-norm must be positive, got {args.clip_norm}")
    _peak_tflops(args)
    if args.plan:
        from pipeloom.tune.plan import Plan

        Plan.load(args.plan)  # one line naming the field that does not hold together


LR_DEFAULTS = {"lr": 1e-3, "lr_schedule": "constant", "warmup_steps": 0, "min_lr": 0.0}
"""The learning-rate flags of a fresh run not given."""


def _learning_rate_flags(args: argparse.Namespace) -> None:
    """Fill the learning-rate flags not given (and --steps): a resumed run continues the curve its
    checkpoint recorded, so the header prints, and the run uses, the checkpoint's values — a
    resume with `--lr 0.05` printed 0.05 and trained at the checkpoint's 0.001."""
    recorded = None
    if args.resume and any(getattr(args, name, None) is None for name in (*LR_DEFAULTS, "steps")):
        from pipeloom.runtime.checkpoint import read_checkpoint
        from pipeloom.runtime.lr_schedule import LRCurve

        recorded = LRCurve.from_record(read_checkpoint(args.resume)[1].get("lr_curve"))
    inherited = LR_DEFAULTS
    if recorded is not None:
        shape = recorded.shape
        inherited = {"lr": recorded.lr, "lr_schedule": shape.kind, "warmup_steps": shape.warmup_steps,
                     "min_lr": shape.min_lr}  # fmt: skip
        if args.steps is None and not getattr(args, "plan", None):
            args.steps = recorded.steps
    for name, value in inherited.items():  # the flags' defaults, on a namespace that has no checks yet
        if getattr(args, name, None) is None:
            setattr(args, name, value)


def steps_of(args: argparse.Namespace) -> int:
    """`--steps`, or its default: a plan's run times `TIMED_PLAN_STEPS` steps after the warm-up."""
    if args.steps is not None:
        return args.steps
    return PLAN_STEPS if getattr(args, "plan", None) else 3


def run_options(args: argparse.Namespace) -> dict:
    """TrainSpec's fields that do not depend on where the schedule comes from (flags or a plan):
    the run, checkpoints, offload, the optimizer's global state."""
    _learning_rate_flags(args)
    steps = steps_of(args)
    fields = {
        "steps": steps,
        "seed": args.seed,
        "lr": args.lr,
        "threads": args.threads,
        "timeout_s": args.timeout,
        "backend": args.backend,
        "save_every": args.save_every,
        "keep_last": args.keep_last,
        "save_dir": args.save,
        "resume_dir": args.resume,
        "allow_input_change": args.allow_input_change,
        "force": args.force,
        "clip_norm": args.clip_norm,
        "post_validation": args.post_validation,
        "dtype": args.dtype or "fp32",
        "device": args.device,
        "zero": args.zero,
        "peak_tflops": _peak_tflops(args),
        "recompute_layers": args.recompute_layers,
        "sequence_parallel": args.sequence_parallel,
        "lr_schedule": args.lr_schedule,
        "warmup_steps": args.warmup_steps,
        "min_lr": args.min_lr,
        "lr_restart": args.lr_restart,
        "eval_every": (args.eval_every or steps) if args.eval_data else 0,
        "eval_batches": args.eval_batches,
        "log_dir": args.log_dir,
        "wandb": args.wandb,
        "overlap_grad_sync": getattr(args, "overlap_grad_sync", True),
        "compile": getattr(args, "compile", False),
    }
    if args.ep is not None:
        fields["ep"] = args.ep
    if args.cp is not None:
        fields["cp"] = args.cp
    if args.offload_stages:
        fields["offload_stages"] = tuple(int_list(args.offload_stages, "--offload-stages"))
    if args.reload_bf16:
        fields["reload_bits"] = 16
    return fields


def _peak_tflops(args: argparse.Namespace) -> float | None:
    if args.peak_tflops is not None and args.hardware:
        raise ConfigError("give --peak-tflops or --hardware, not both")
    if args.peak_tflops is not None:
        if args.peak_tflops <= 0:
            raise ConfigError(f"--peak-tflops must be positive, got {args.peak_tflops}")
        return args.peak_tflops
    if args.hardware:
        from pipeloom.tune.presets import load_hardware

        return load_hardware(args.hardware).peak_flops / 1e12
    return None
