"""`pipeloom export CHECKPOINT --output DIR`: a training checkpoint as a transformers model directory."""

from __future__ import annotations

import argparse
from pathlib import Path

from pipeloom.cli.parser import add_command
from pipeloom.errors import ConfigError

__all__ = ["register"]


def register(commands) -> None:
    parser = add_command(
        commands,
        "export",
        "write a checkpoint's model as a transformers directory (config.json + safetensors)",
        [
            "pipeloom export ck/step-4 --output hf-dir",
            "pipeloom export ck --output hf-dir --dtype bf16   # the newest checkpoint in ck",
        ],
    )
    parser.add_argument("checkpoint", metavar="CHECKPOINT", help="a step-N directory written by train --save, or DIR")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="the transformers directory to write")
    parser.add_argument(
        "--dtype", choices=("fp32", "bf16"), default="fp32", help="the saved weights' type (default fp32)"
    )
    parser.add_argument("--force", action="store_true", help="write into a directory that already holds a model")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from pipeloom.runtime.run_outputs import OWNER_FILE

    out = Path(args.output)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"export: --output {args.output!r} is a file, not a directory")
    source = Path(args.checkpoint).resolve()
    if out.resolve() == source or source in out.resolve().parents:
        raise ConfigError(f"export: --output {args.output!r} lies inside the checkpoint it exports; write it elsewhere")
    if out.is_dir() and (any(out.glob("step-*")) or (out / OWNER_FILE).exists()):  # even with --force
        raise ConfigError(
            f"export: --output {args.output!r} holds a training run's checkpoints or logs; export into a directory "
            "of its own"
        )
    if (out / "config.json").exists() and not args.force:
        raise ConfigError(f"export: {args.output!r} already holds a model; choose another --output or add --force")
    from pipeloom.runtime.export import export_checkpoint

    chosen = export_checkpoint(args.checkpoint, out, args.dtype)
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"exported {chosen} → {out}/ ({', '.join(files)}; {size / 2**20:.2f} MiB)")
    return 0
