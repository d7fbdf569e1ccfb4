"""The learning rate over a run: warm-up, then constant, linear or cosine decay to a floor —
torch's own schedulers (`torch.optim.lr_scheduler`), one per optimizer a rank steps.

Step n trains at ``lr · (n + 1) / (w + 1)`` while n < w (the warm-up: `LinearLR` from
1 / (w + 1)), then follows the decay from ``lr`` at step w to ``min_lr`` at the last step
(`LinearLR` down to min_lr / lr, or `CosineAnnealingLR` with eta_min = min_lr), joined by
`SequentialLR`. Every scheduler steps right after its optimizer — the host's (T-Offload) in the
host's worker, after its step in flight — so each step's update uses that step's rate, whether
the step ran or was skipped (the curve is a function of the step number). Its state goes into
checkpoints, so a resumed run continues the curve exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim import lr_scheduler

from pipeloom.errors import ConfigError

__all__ = ["LRSchedule", "SCHEDULES", "build_scheduler", "LearningRate"]

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LRSchedule:
    """`--lr-schedule`, `--warmup-steps`, `--min-lr` over a run of `steps` steps."""

    kind: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0

    def check(self, lr: float, steps: int) -> None:
        if self.kind not in SCHEDULES:
            raise ConfigError(f"train: --lr-schedule must be one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ConfigError(f"train: --warmup-steps must be a non-negative integer, got {self.warmup_steps!r}")
        if self.warmup_steps >= steps and self.kind != "constant":
            raise ConfigError(
                f"train: --warmup-steps {self.warmup_steps} leaves no step of the {self.kind} decay in "
                f"{steps} --steps; warm up for fewer steps"
            )
        if not 0.0 <= self.min_lr <= lr:
            raise ConfigError(f"train: --min-lr must lie in [0, --lr = {lr:g}], got {self.min_lr:g}")

    @property
    def varies(self) -> bool:
        return self.kind != "constant" or self.warmup_steps > 0


def build_scheduler(optimizer: torch.optim.Optimizer, schedule: LRSchedule, steps: int) -> lr_scheduler.LRScheduler:
    """The torch scheduler of `schedule` on `optimizer` (whose rate is the peak), for `steps` steps."""
    lr = optimizer.param_groups[0]["lr"]
    warmup, decay_steps = schedule.warmup_steps, max(1, steps - 1 - schedule.warmup_steps)
    decay: lr_scheduler.LRScheduler
    if schedule.kind == "linear":
        end = schedule.min_lr / lr if lr > 0 else 1.0
        decay = lr_scheduler.LinearLR(optimizer, start_factor=1.0, end_factor=end, total_iters=decay_steps)
    elif schedule.kind == "cosine":
        decay = lr_scheduler.CosineAnnealingLR(optimizer, T_max=decay_steps, eta_min=schedule.min_lr)
    else:
        decay = lr_scheduler.ConstantLR(optimizer, factor=1.0, total_iters=0)
    if not warmup:
        return decay
    rise = lr_scheduler.LinearLR(optimizer, start_factor=1.0 / (warmup + 1), end_factor=1.0, total_iters=warmup)
    return lr_scheduler.SequentialLR(optimizer, [rise, decay], milestones=[warmup])


class LearningRate:
    """A rank's schedulers, stepped together: each with its runner (the host's worker for
    T-Offload's optimizer, in order after the step it follows; at once for the others)."""

    def __init__(self) -> None:
        self.parts: list[tuple[lr_scheduler.LRScheduler, Callable[[Callable[[], None]], None]]] = []

    def add(self, scheduler: lr_scheduler.LRScheduler, runner: Callable[[Callable[[], None]], None] | None = None):
        self.parts.append((scheduler, runner or (lambda call: call())))

    @property
    def current(self) -> float | None:
        """The rate the next step trains at (None: this rank steps no optimizer)."""
        return float(self.parts[0][0].get_last_lr()[0]) if self.parts else None

    def step(self) -> None:
        for scheduler, runner in self.parts:
            runner(scheduler.step)

    def state_dict(self) -> dict | None:
        """The schedule's position (every part is at the same one, once the host's step is done)."""
        return self.parts[0][0].state_dict() if self.parts else None

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            return
        for scheduler, _ in self.parts:
            scheduler.load_state_dict(state)
            # a scheduler's state does not reach the optimizer, and the chainable ones (cosine)
            # compute the next rate from the optimizer's current one: put the saved rate back
            for group, rate in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = rate
