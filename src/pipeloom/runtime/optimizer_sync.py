"""Global clipping / skipping (also fp16's overflow skip): synchronous, or post-validated (Zero
Bubble §4).

Clipping by the global gradient norm and skipping a step with NaN/Inf gradients need a state
reduced over every stage. The synchronous way all-reduces it across the pipeline before any stage
steps — a barrier at the end of every step. Post-validation instead passes a partial state down
the pipeline (device d receives the sum of devices < d, adds its own, passes it on) and steps at
once under that partial state; the last device holds the full state and sends it back up the
pipeline. Each device then checks its step: if the full state asks for another clipping
coefficient or a skip, the step is rolled back in place — AdamW is arithmetically reversible
(appendix C) — and redone. Each stage counts once: on the lowest device hosting it (Chimera's
two copies) and within one data-parallel replica (the replicas' gradients are equal after the
all-reduce, so every replica reaches the same decision on its own).

Nothing here reads the device on the host while the step runs: the state is [sum of squares,
non-finite gradients] as one device tensor (`torch._foreach_norm` per rank), the decision
[stepped, coefficient] is computed from it on the device (`decide`), the gradients are scaled by
that tensor and a skip is AdamW's own `found_inf` (its fused kernel leaves weights, moments and
step count alone). The host learns the decisions once, at the step's end, together with the
loss (`to_read`, `settle`); only a post-validated step the full state overturns then takes the
host's path (the rollback, the redo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pipeloom.runtime.mailbox import posted

__all__ = ["OptimizerSync", "decide", "adamw_rollback", "step_under"]

_TAG = 1 << 24  # above every activation tag


def decide(state: torch.Tensor, clip_norm: float | None) -> torch.Tensor:
    """[stepped (1 or 0), clipping coefficient] of a reduced [squares, non-finite count], on the
    state's device: skip a step with any non-finite gradient; clip when the norm exceeds
    `clip_norm`."""
    squares, bad = state[0], state[1]
    finite = (bad == 0) & torch.isfinite(squares)
    coefficient = torch.ones_like(squares)
    if clip_norm is not None:
        norm = squares.sqrt()
        coefficient = torch.where(finite & (norm > clip_norm), clip_norm / (norm + 1e-6), coefficient)
    return torch.stack((finite.to(squares.dtype), coefficient))


def step_under(optimizer: torch.optim.Optimizer, decision: torch.Tensor | None) -> None:
    """`optimizer.step()`, skipped on the device when `decision` says so (fused AdamW reads
    `found_inf`, as under torch's GradScaler)."""
    if decision is None:
        optimizer.step()
        return
    device = optimizer.param_groups[0]["params"][0].device
    optimizer.found_inf = (1 - decision[0]).to(device=device, dtype=torch.float32)  # type: ignore[attr-defined]
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf  # type: ignore[attr-defined]


def adamw_rollback(optimizer: torch.optim.AdamW) -> None:
    """Undo the last AdamW step in place, given the gradients it used (Zero Bubble Algorithm 1),
    on the device: the step count stays a tensor (its bias corrections too). The second moment is
    kept non-negative: where it was zero before the step, undoing (1 − β2)·g² rounds to about
    −1e-16, whose square root is NaN."""
    with torch.no_grad():
        for group in optimizer.param_groups:
            lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for parameter in group["params"]:
                state = optimizer.state.get(parameter)
                if not state or parameter.grad is None:
                    continue
                t = state["step"].to(device=parameter.device, dtype=torch.float64)
                m, v, g = state["exp_avg"], state["exp_avg_sq"], parameter.grad
                denom = (v.sqrt() / (1 - beta2**t).sqrt()).add_(eps)
                parameter.add_(m / denom * (lr / (1 - beta1**t))).div_(1 - lr * decay)
                m.sub_(g, alpha=1 - beta1).div_(beta1)
                v.addcmul_(g, g, value=-(1 - beta2)).div_(beta2).clamp_(min=0)
                state["step"] -= 1


@dataclass
class _Pending:
    decision: torch.Tensor
    """What this rank stepped under: [stepped, coefficient] of the partial state."""
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
        tensor_group=None,
        local_state=None,
    ) -> None:
        self.stepper, self.clip_norm = stepper, clip_norm
        self.post_validation = post_validation
        self.device, self.p, self.rank_of = device, num_devices, rank_of
        self.group = pipeline_group
        self.timeout = timedelta(seconds=timeout_s)
        self.pending: _Pending | None = None
        self.decision: torch.Tensor | None = None
        """The synchronous step's decision, for the host to learn at the step's end."""
        self.rollbacks = 0
        self.skipped = 0
        self.on_decision = on_decision
        """Called once per step with its final decision (stepped or skipped): fp16's loss scale."""
        self.tensor_group = tensor_group
        """This rank's tensor-parallel group: post-validation sums a device's shards there first."""
        self.local_state = local_state or stepper.local_state
        """This rank's [squares, non-finite count] (expert parallelism adds its group's experts)."""
        self.state: torch.Tensor | None = None
        """The synchronous step's reduced state, for the host to learn the norm at the step's end."""
        self.norms: list[float] = []
        """Each step's global gradient norm, before clipping (NaN where a gradient was not finite)."""

    def _apply(self, decision: torch.Tensor) -> None:
        """Scale by the decision's coefficient (when clipping) and step, skipped where it says so —
        on the device."""
        if self.clip_norm is not None:
            self.stepper.scale(decision[1])
        self.stepper.step(decision)

    def step(self, step: int) -> None:
        """Instead of optimizer.step(), once this rank's gradients are final."""
        local = self.local_state()
        device = local.device
        if not self.post_validation:
            dist.all_reduce(local, group=self.group)
            self.state, self.decision = local, decide(local, self.clip_norm)
            self._apply(self.decision)
            return
        if self.tensor_group is not None:  # the device's state: its shards summed over the group
            dist.all_reduce(local, group=self.tensor_group)
        tag = _TAG + 4 * step
        partial = local.clone()
        if self.device > 0:
            received = torch.zeros(2, dtype=torch.float64, device=device)
            posted(dist.irecv(received, src=self.rank_of(self.device - 1), tag=tag)).wait(self.timeout)
            partial += received
        if self.device < self.p - 1:
            posted(dist.isend(partial.clone(), dst=self.rank_of(self.device + 1), tag=tag)).wait(self.timeout)
        decision = decide(partial, self.clip_norm)
        self._apply(decision)
        full, work = partial, None
        work_tag = tag + 1
        if self.device == self.p - 1:  # the full state starts back up the pipeline
            if self.device > 0:
                posted(dist.isend(full.clone(), dst=self.rank_of(self.device - 1), tag=work_tag)).wait(self.timeout)
        else:
            full = torch.zeros(2, dtype=torch.float64, device=device)
            work = posted(dist.irecv(full, src=self.rank_of(self.device + 1), tag=work_tag))
        self.pending = _Pending(decision, full, work, work_tag)

    def to_read(self) -> list[torch.Tensor]:
        """The decisions the host learns at the step's end, as device tensors: the step's, or
        (post-validated) the one it stepped under and the full state's — received from the next
        device and passed on up the pipeline first."""
        if not self.post_validation:
            assert self.decision is not None and self.state is not None, "step() ran"
            return [self.decision, self.state]
        pending = self.pending
        assert pending is not None, "step() ran"
        if pending.work is not None:
            pending.work.wait(self.timeout)
            if self.device > 0:
                full = pending.full.clone()
                posted(dist.isend(full, dst=self.rank_of(self.device - 1), tag=pending.tag)).wait(self.timeout)
        return [pending.decision, decide(pending.full, self.clip_norm), pending.full]

    def settle(self, values: list[float]) -> None:
        """Given `to_read`'s values on the host: book the step's decision, and redo a
        post-validated step the full state decided otherwise."""
        self.norms.append(math.sqrt(values[-2]) if values[-1] == 0 else math.nan)  # the full state's
        if not self.post_validation:
            self._book(values[0] == 1.0)
            self.decision = self.state = None
            return
        (stepped_partial, coefficient_partial, stepped, coefficient, _, _), self.pending = values, None
        self._book(stepped == 1.0)
        if (stepped_partial, coefficient_partial) == (stepped, coefficient):
            return
        self.rollbacks += 1
        scale = 1.0
        if stepped_partial == 1.0:
            self.stepper.rollback()
            scale = 1.0 / coefficient_partial  # back to the unclipped gradients
        if stepped == 1.0:
            self.stepper.scale(scale * coefficient)
            self.stepper.step()

    def _book(self, stepped: bool) -> None:
        self.skipped += not stepped
        if self.on_decision is not None:
            self.on_decision(stepped)
