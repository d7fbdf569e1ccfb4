"""T-Offload in the runtime (TPipe §5): deep stages' optimizer on the host, off the compute thread.

For each offloaded stage (any set of them) a rank keeps host buffers of its own — fp32 master
weights, gradients and the AdamW state — and the device keeps only the weights its passes use (in
the compute type under mixed precision) and an fp32 gradient buffer (`GradientStore`): 6 bytes per
weight in bf16 where ZeRO-0 holds 16 (`pipeloom.static_memory`). At the end of a step, once
gradients are reduced, OFFLOAD copies the stage's gradients into the host buffers; HOST_STEP then runs AdamW on the host copies in a worker thread while the
rank goes on (the next step's other stages, its data); RELOAD waits for that step and copies the
new weights back just before the stage's first forward of the next step — optionally rounded
through bfloat16 (`reload_bits=16`), as a quantized reload would be. Without a GPU the buffers are
still separate tensors, so every copy is real and, in fp32, the final parameters must equal a run
without offload exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.gradients import GradientStore, unique_parameters
from pipeloom.runtime.optimizer_sync import adamw_rollback, step_under
from pipeloom.runtime.zero import adamw, adamw_slot, squares_and_bad

__all__ = ["HostOffload"]


class HostOffload:
    def __init__(
        self,
        stages: dict[int, nn.Module],
        offloaded: Sequence[int],
        lr: float,
        reload_bits: int = 32,
        weight_dtype: torch.dtype = torch.float32,
        owned=lambda parameter: True,
        dp_group=None,
        routed: tuple[set[int], object] = (set(), None),
    ):
        """`owned`: whether this rank counts a parameter in the global gradient norm; `dp_group`:
        the data-parallel group to sum the gradients over, when the gradient buckets do not —
        and `routed` (ids of expert shards, the group of their copies): the expert shards' sum,
        over the replicas that hold the same experts."""
        self.device_params = {s: list(stages[s].parameters()) for s in offloaded}
        self.master = {s: [p.detach().to("cpu", copy=True) for p in params] for s, params in self.device_params.items()}
        for masters in self.master.values():
            for master in masters:
                master.grad = torch.zeros_like(master)
        with torch.no_grad():
            for parameter in unique_parameters([stages[s] for s in offloaded]):
                parameter.data = parameter.data.to(weight_dtype)
        experts, self.expert_group = routed
        held = unique_parameters([stages[s] for s in offloaded])
        # the expert shards last in the buffer: each part sums over its own group
        held = [p for p in held if id(p) not in experts] + [p for p in held if id(p) in experts]
        self.store = GradientStore(held, torch.float32)
        self.dense_numel = sum(p.numel() for p in held if id(p) not in experts)
        self.owned = [p for p in self.store.parameters if owned(p)]
        self.dp_group = dp_group
        self.optimizer = adamw([m for masters in self.master.values() for m in masters], lr)
        self.reload_bits = reload_bits
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="host-step")
        self._step: Future | None = None
        self._stale: set[int] = set()
        self.events: list[tuple[str, float, float]] = []
        """(op text, start, end) in perf_counter seconds: OFFLOAD, HOST_STEP, RELOAD of each stage."""

    @property
    def stages(self) -> list[int]:
        return list(self.device_params)

    # The optimizer interface of `pipeloom.runtime.zero` (stepped through `JointSteppers`):

    def zero_grad(self) -> None:
        self.store.zero()

    def reduce(self) -> None:
        if self.dp_group is None:
            return
        flat, split = self.store.flat, self.dense_numel
        dist.all_reduce(flat[:split], group=self.dp_group)
        if split < flat.numel():
            dist.all_reduce(flat[split:], group=self.expert_group)

    def local_state(self) -> torch.Tensor:
        return squares_and_bad([self.store.grad_of(p) for p in self.owned], self.store.flat.device)

    def owned_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its gradient) of those this rank counts in the global norm."""
        return [(p, self.store.grad_of(p)) for p in self.owned]

    def scale(self, factor: float | torch.Tensor) -> None:
        self.store.flat.mul_(factor)

    def step(self, decision: torch.Tensor | None = None) -> None:
        self.offload_and_step(decision)

    def rollback(self) -> None:
        """Undo the last host step (its gradients are still in the masters' .grad); every stage
        reloads the restored weights before its next forward."""
        self.settle()
        adamw_rollback(self.optimizer)
        self._stale = set(self.device_params)

    @property
    def host_bytes(self) -> int:
        """fp32 master weights, their gradients and AdamW's two moments on the host, as allocated."""
        masters = [m for masters in self.master.values() for m in masters]
        held = [t for m in masters for t in (m, m.grad)] + [
            v for slot in self.optimizer.state.values() for k, v in slot.items() if k != "step"
        ]
        return sum(t.numel() * t.element_size() for t in held)

    def offload_and_step(self, decision: torch.Tensor | None = None) -> None:
        """OFFLOAD every offloaded stage's gradients, then start HOST_STEP in the worker (skipped
        where `decision` says so: the host's optimizer needs it on the host, so a GPU run reads
        these two numbers here, as it copies the gradients)."""
        for stage, params in self.device_params.items():
            began = time.perf_counter()
            for parameter, master in zip(params, self.master[stage]):
                assert master.grad is not None, "set to zeros when the host copy was made"
                master.grad.copy_(self.store.grad_of(parameter))
            self.events.append((f"{stage}OFFLOAD", began, time.perf_counter()))
        self._stale = set(self.device_params)
        on_host = decision.to("cpu") if decision is not None else None
        self._step = self._worker.submit(self._host_step, on_host)

    def _host_step(self, decision: torch.Tensor | None = None) -> None:
        began = time.perf_counter()
        step_under(self.optimizer, decision)
        self.events.append(("HOST_STEP", began, time.perf_counter()))

    def after_pending(self, call) -> None:
        """Run `call` in the host's worker once the step in flight is done (its learning-rate
        step: the next host step then uses the next rate, and the device never waits for it)."""
        previous = self._step

        def chained() -> None:
            if previous is not None:
                previous.result()
            call()

        self._step = self._worker.submit(chained)

    def settle(self) -> None:
        """Wait for the host's work in flight."""
        if self._step is not None:
            self._step.result()

    def reload(self, stage: int) -> None:
        """RELOAD a stage's new weights, if the host has stepped it since the last reload."""
        if stage not in self._stale:
            return
        self.settle()
        began = time.perf_counter()
        with torch.no_grad():
            for parameter, master in zip(self.device_params[stage], self.master[stage]):
                weights = master if self.reload_bits == 32 else master.to(torch.bfloat16).float()
                parameter.copy_(weights)
        self._stale.discard(stage)
        self.events.append((f"{stage}RELOAD", began, time.perf_counter()))

    def checkpoint_state(
        self, keys: dict[int, str], masters: bool = False, by_name: bool = False
    ) -> dict[str, torch.Tensor]:
        """The host's fp32 master weights and AdamW state, once the step in flight is done, under
        ``host.stageS.NAME`` (a tensor- or expert-parallel shard goes in as its part of the whole,
        as the weights do, so each rank of a group resumes its own); with `masters` (a save) also
        by each weight's name in the whole model, as a replicated optimizer keeps them
        (`master.NAME`, `optim.NAME.*`: what `export` writes and another layout resumes from);
        with `by_name` (a load of another layout's) by name only."""
        self.settle()
        state: dict[str, torch.Tensor] = {}
        for stage, kept in self.master.items():
            for master, parameter in zip(kept, self.device_params[stage]):
                slot = adamw_slot(self.optimizer, master)
                fields = ("step", "exp_avg", "exp_avg_sq")
                key = keys[id(parameter)]
                if not by_name:  # by stage too: a weight tied over two offloaded stages has two masters
                    state[f"host.stage{stage}.{key}.master"] = master.data
                    state.update({f"host.stage{stage}.{key}.{field}": slot[field] for field in fields})
                if masters or by_name:
                    state[f"master.{key}"] = master.data
                    state.update({f"optim.{key}.{field}": slot[field] for field in fields})
        return state

    def after_load(self) -> None:
        """The loaded master weights are the truth: every stage reloads before its first forward."""
        self._stale = set(self.device_params)

    def finish(self) -> None:
        """Reload what is still on the host (after the last step) and stop the worker."""
        for stage in list(self._stale):
            self.reload(stage)
        self._worker.shutdown()
