"""Global gradient clipping and non-finite skipping: synchronous, or post-validated (Zero Bubble §4).

Clipping by the global gradient norm and skipping a step with NaN/Inf gradients need a state
reduced over every stage. The synchronous way all-reduces it across the pipeline before any stage
steps — a barrier at the end of every step. Post-validation instead passes a partial state down
the pipeline (device d receives the sum of devices < d, adds its own, passes it on) and steps at
once under that partial state; the last device holds the full state and sends it back up the
pipeline while the next step starts. Each device then checks its step: if the full state asks for
another clipping coefficient or a skip, the step is rolled back in place — AdamW is arithmetically
reversible (appendix C) — and redone. Each stage counts once: on the lowest device hosting it
(Chimera's two copies) and within one data-parallel replica (the replicas' gradients are equal
after the all-reduce, so every replica reaches the same decision on its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.runtime.mailbox import posted

__all__ = ["OptimizerSync", "decide", "adamw_rollback"]

_TAG = 1 << 24  # above every activation tag


def decide(squares: float, finite: bool, clip_norm: float | None) -> tuple[bool, float]:
    """(step or skip, clipping coefficient) for a reduced state."""
    if not finite:
        return False, 1.0
    norm = math.sqrt(squares)
    if clip_norm is not None and norm > clip_norm:
        return True, clip_norm / (norm + 1e-6)
    return True, 1.0


def adamw_rollback(optimizer: torch.optim.AdamW) -> None:
    """Undo the last AdamW step in place, given the gradients it used (Zero Bubble Algorithm 1)."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for parameter in group["params"]:
                state = optimizer.state.get(parameter)
                if not state or parameter.grad is None:
                    continue
                t = float(state["step"])
                m, v, g = state["exp_avg"], state["exp_avg_sq"], parameter.grad
                denom = (v.sqrt() / math.sqrt(1 - beta2**t)).add_(eps)
                parameter.addcdiv_(m, denom, value=lr / (1 - beta1**t)).div_(1 - lr * decay)
                m.sub_(g, alpha=1 - beta1).div_(beta1)
                v.addcmul_(g, g, value=-(1 - beta2)).div_(beta2)
                state["step"] -= 1


@dataclass
class _Pending:
    stepped: bool
    coefficient: float
    full: torch.Tensor
    work: dist.Work | None
    """The receive of the full state from the next device (None on the last)."""
    tag: int


class OptimizerSync:
    """Drives one rank's optimizer step under the global state (see the module docstring).
    `stepper` is the rank's optimizer (`pipeloom.runtime.zero`): replicated or ZeRO-sharded."""

    def __init__(
        self,
        stepper,
        clip_norm: float | None,
        post_validation: bool,
        device: int,
        num_devices: int,
        rank_of,
        pipeline_group,
        timeout_s: float,
        on_decision=None,
    ) -> None:
        self.stepper, self.clip_norm = stepper, clip_norm
        self.post_validation = post_validation
        self.device, self.p, self.rank_of = device, num_devices, rank_of
        self.group = pipeline_group
        self.timeout = timedelta(seconds=timeout_s)
        self.pending: _Pending | None = None
        self.rollbacks = 0
        self.skipped = 0
        self.on_decision = on_decision
        """Called once per step with its final decision (stepped or skipped): fp16's loss scale."""

    def _apply(self, stepped: bool, coefficient: float) -> None:
        if not stepped:
            self.skipped += 1
            return
        if coefficient != 1.0:
            self.stepper.scale(coefficient)
        self.stepper.step()

    def _decided(self, stepped: bool) -> None:
        if self.on_decision is not None:
            self.on_decision(stepped)

    def step(self, step: int) -> None:
        """Instead of optimizer.step(), once this rank's gradients are final."""
        local = self.stepper.local_state()
        device = local.device
        if not self.post_validation:
            dist.all_reduce(local, group=self.group)
            stepped, coefficient = decide(float(local[0]), float(local[1]) == 0, self.clip_norm)
            self._apply(stepped, coefficient)
            self._decided(stepped)
            return
        tag = _TAG + 4 * step
        partial = local.clone()
        if self.device > 0:
            received = torch.zeros(2, dtype=torch.float64, device=device)
            posted(dist.irecv(received, src=self.rank_of(self.device - 1), tag=tag)).wait(self.timeout)
            partial += received
        if self.device < self.p - 1:
            posted(dist.isend(partial.clone(), dst=self.rank_of(self.device + 1), tag=tag)).wait(self.timeout)
        stepped, coefficient = decide(float(partial[0]), float(partial[1]) == 0, self.clip_norm)
        self._apply(stepped, coefficient)
        full, work = partial, None
        work_tag = tag + 1
        if self.device == self.p - 1:  # the full state starts back up the pipeline
            if self.device > 0:
                posted(dist.isend(full.clone(), dst=self.rank_of(self.device - 1), tag=work_tag)).wait(self.timeout)
        else:
            full = torch.zeros(2, dtype=torch.float64, device=device)
            work = posted(dist.irecv(full, src=self.rank_of(self.device + 1), tag=work_tag))
        self.pending = _Pending(stepped, coefficient, full, work, work_tag)

    def validate(self) -> None:
        """At the next step's start (and after the last step): check the optimistic step against
        the full state; roll back and redo it if they disagree."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        work, tag = pending.work, pending.tag
        if work is not None:
            work.wait(self.timeout)
            if self.device > 0:
                posted(dist.isend(pending.full.clone(), dst=self.rank_of(self.device - 1), tag=tag)).wait(self.timeout)
        stepped, coefficient = decide(float(pending.full[0]), float(pending.full[1]) == 0, self.clip_norm)
        self._decided(stepped)
        if (stepped, coefficient) == (pending.stepped, pending.coefficient):
            return
        self.rollbacks += 1
        if pending.stepped:
            self.stepper.rollback()
            scale = 1.0 / pending.coefficient  # back to the unclipped gradients
        else:
            self.skipped -= 1
            scale = 1.0
        if stepped and scale != 1.0:
            self.stepper.scale(scale)
        self._apply(stepped, coefficient)
