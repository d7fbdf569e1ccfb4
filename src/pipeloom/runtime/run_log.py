"""A run's metrics on disk: TensorBoard event files and ``metrics.jsonl``, and Weights & Biases.

One rank writes them (the one holding the last stage of the first replica, whose loss it
computes): a JSON line and TensorBoard scalars per step — loss, learning rate, tokens/s, TFLOP/s
and MFU of that rank, its peak stash and memory, the loss scale — and per evaluation the held-out
loss and perplexity. The run's configuration opens the log (a JSON line and TensorBoard text).
Weights & Biases is used only when asked for (`--wandb PROJECT`) and installed; without a
``WANDB_MODE`` it runs offline, so nothing leaves the machine unless the user says so.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = ["RunLog", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"


class RunLog:
    def __init__(self, directory: str | os.PathLike[str], config: dict | None = None, wandb: str | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError(
                "train: --log-dir writes TensorBoard files: install tensorboard (pip install 'pipeloom[logs]')"
            ) from None
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(self.directory))
        self.lines = (self.directory / METRICS_FILE).open("a", encoding="utf-8")
        self.wandb = None
        if wandb is not None:
            self.wandb = _start_wandb(wandb, self.directory, config)
        if config is not None:
            self.writer.add_text("config", "```\n" + json.dumps(config, indent=1, default=str) + "\n```", 0)
            self._line({"config": config})

    def step(self, step: int, facts: dict) -> None:
        """Step `step` (1-based: the steps done) and its figures (None: not measured here)."""
        figures = {key: value for key, value in facts.items() if value is not None}
        self._line({"step": step, **figures})
        for key, value in figures.items():
            if isinstance(value, int | float):
                self.writer.add_scalar(_tag(key), value, step)
        if self.wandb is not None:
            self.wandb.log(figures, step=step)

    def close(self) -> None:
        self.writer.close()
        self.lines.close()
        if self.wandb is not None:
            self.wandb.finish()

    def _line(self, record: dict) -> None:
        self.lines.write(json.dumps(record, default=str) + "\n")
        self.lines.flush()


def _tag(key: str) -> str:
    """TensorBoard's grouping: eval/…, train/… (loss, lr), perf/… (throughput), memory/…."""
    if key.startswith("eval_"):
        return f"eval/{key[5:]}"
    if key in ("loss", "lr", "loss_scale"):
        return f"train/{key}"
    if key.endswith("_bytes"):
        return f"memory/{key}"
    return f"perf/{key}"


def _start_wandb(project: str, directory: Path, config: dict | None):
    try:
        import wandb
    except ImportError:
        raise ConfigError("train: --wandb needs Weights & Biases: pip install wandb") from None
    return wandb.init(
        project=project, dir=str(directory), config=config or {}, mode=os.environ.get("WANDB_MODE", "offline")
    )
