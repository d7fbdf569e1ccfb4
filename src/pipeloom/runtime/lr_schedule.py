"""The learning rate over a run: warm-up, then constant, linear or cosine decay to a floor —
torch's own schedulers (`torch.optim.lr_scheduler`), one per optimizer a rank steps.

Step n trains at ``lr · (n + 1) / (w + 1)`` while n < w (the warm-up: `LinearLR` from
1 / (w + 1)), then follows the decay from ``lr`` at step w to ``min_lr`` at the last step
(`LinearLR` down to min_lr / lr, or `CosineAnnealingLR` with eta_min = min_lr), joined by
`SequentialLR`. Every scheduler steps right after its optimizer — the host's (T-Offload) in the
host's worker, after its step in flight — so each step's update uses that step's rate, whether
the step ran or was skipped (the curve is a function of the step number).

A checkpoint records the curve (`LRCurve`: peak, shape, the steps it spans), not the schedulers'
state, and a resumed run rebuilds its schedulers and steps them to the resumed step: the same
arithmetic in the same order as the run that never stopped, so it continues bit for bit. What
the resumed run asks for differently (another peak, floor, shape or length, or a new curve from
the resumed step: `restart`) applies from that step on (`resumed_curve`), and the rank says so.
Lengthening a decay that has ended is refused: the rate would climb back up.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.optim import lr_scheduler

from pipeloom.errors import ConfigError

__all__ = ["LRCurve", "LRSchedule", "SCHEDULES", "build_scheduler", "LearningRate", "resumed_curve"]

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


@dataclass(frozen=True)
class LRCurve:
    """The rate of every step of a run: its peak `lr` and `shape`, over steps `start` to
    `steps` − 1 (`start` > 0: a schedule begun anew at a resumed step)."""

    lr: float
    shape: LRSchedule
    steps: int
    start: int = 0

    def record(self) -> dict:
        shape = self.shape
        return {"lr": self.lr, "kind": shape.kind, "warmup_steps": shape.warmup_steps, "min_lr": shape.min_lr,
                "steps": self.steps, "start": self.start}  # fmt: skip

    @staticmethod
    def from_record(record: dict | None) -> LRCurve | None:
        """The curve a checkpoint recorded (None: one written before curves were recorded)."""
        if record is None:
            return None
        try:
            shape = LRSchedule(str(record["kind"]), int(record["warmup_steps"]), float(record["min_lr"]))
            curve = LRCurve(float(record["lr"]), shape, int(record["steps"]), int(record.get("start", 0)))
            shape.check(curve.lr, curve.steps - curve.start)
        except (KeyError, TypeError, ValueError, ConfigError):
            raise ConfigError(f"an unreadable learning-rate curve: {record!r}") from None
        return curve

    @property
    def decays(self) -> bool:
        return self.shape.kind != "constant"

    def rate_at(self, step: int) -> float:
        """The rate step `step` trains at (computed by the schedulers a run builds)."""
        optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.lr)
        return float(self.scheduler_at(optimizer, step).get_last_lr()[0])

    def scheduler_at(self, optimizer: torch.optim.Optimizer, step: int) -> lr_scheduler.LRScheduler:
        """A scheduler of this curve on `optimizer`, whatever its rate was, stepped to `step`."""
        for group in optimizer.param_groups:
            group["lr"] = group["initial_lr"] = self.lr
        scheduler = build_scheduler(optimizer, self.shape, self.steps - self.start)
        with warnings.catch_warnings():  # stepped ahead of an optimizer that has not stepped yet
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(step - self.start):
                scheduler.step()
        return scheduler

    def __str__(self) -> str:
        warm = f" after {self.shape.warmup_steps} warm-up steps" if self.shape.warmup_steps else ""
        span = f"steps {self.start}–{self.steps}" if self.start else f"{self.steps} steps"
        if not self.decays:
            return f"constant {self.lr:g}{warm} over {span}"
        return f"{self.shape.kind} from {self.lr:g} to {self.shape.min_lr:g}{warm} over {span}"


def resumed_curve(asked: LRCurve, recorded: LRCurve | None, done: int, restart: bool = False) -> LRCurve:
    """The curve a run resumed after `done` steps trains on: `asked` (the command's peak, shape
    and length), over the span of the `recorded` run's curve — or beginning at `done` with
    `restart`. ConfigError where `asked` only lengthens a decay that has ended, which would
    climb back up: the options are its floor or a new curve."""
    start = done if restart else (recorded.start if recorded is not None else 0)
    curve = LRCurve(asked.lr, asked.shape, asked.steps, start)
    if restart:
        curve.shape.check(curve.lr, curve.steps - start)
    if recorded is None or restart or not recorded.decays or done < recorded.steps:
        return curve
    if curve.steps > recorded.steps and replace(curve, steps=recorded.steps) == recorded:
        floor = recorded.shape.min_lr
        at_floor = f"--lr-schedule constant --lr {floor:g} --warmup-steps 0" if floor > 0 else None
        raise ConfigError(
            f"train: the checkpoint's {recorded} ended at step {recorded.steps}; --steps {curve.steps} would "
            f"lengthen it and the rate would climb back to {curve.rate_at(done):g}. "
            + (f"Continue at its floor with {at_floor}, or" if at_floor else "Its floor is 0, so give")
            + f" a new schedule from step {done} with --lr-restart (and --lr, --lr-schedule, --warmup-steps, "
            "--min-lr for it)"
        )
    return curve


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
    T-Offload's optimizer, in order after the step it follows; at once for the others), and the
    curve they follow."""

    def __init__(self, curve: LRCurve) -> None:
        self.parts: list[tuple[lr_scheduler.LRScheduler, Callable[[Callable[[], None]], None]]] = []
        self.curve = curve

    def add(self, optimizer: torch.optim.Optimizer, runner: Callable[[Callable[[], None]], None] | None = None):
        self.parts.append((self.curve.scheduler_at(optimizer, self.curve.start), runner or (lambda call: call())))

    @property
    def current(self) -> float | None:
        """The rate the next step trains at (None: this rank steps no optimizer)."""
        return float(self.parts[0][0].get_last_lr()[0]) if self.parts else None

    def step(self) -> None:
        for scheduler, runner in self.parts:
            runner(scheduler.step)

    def resume(self, curve: LRCurve, step: int) -> None:
        """Follow `curve` from `step` on (every runner idle: nothing of an earlier step pending)."""
        self.curve = curve
        self.parts = [(curve.scheduler_at(scheduler.optimizer, step), runner) for scheduler, runner in self.parts]

    def load_state_dict(self, state: dict | None) -> None:
        """The schedulers' state from a checkpoint that recorded no curve (an older one)."""
        if state is None:
            return
        for scheduler, _ in self.parts:
            scheduler.load_state_dict(state)
            # a scheduler's state does not reach the optimizer, and the chainable ones (cosine)
            # compute the next rate from the optimizer's current one: put the saved rate back
            for group, rate in zip(scheduler.optimizer.param_groups, scheduler.get_last_lr()):
                group["lr"] = rate
