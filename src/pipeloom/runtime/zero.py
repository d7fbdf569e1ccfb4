"""Static memory as the planner counts it: gradient buffers, ZeRO-sharded AdamW, weights in the
compute type.

Three ways a rank steps the weights it holds, one interface (`local_state`, `reduce`, `scale`,
`step`, `rollback`, `checkpoint_state`), so clipping, post-validation, the fp16 loss scale and
checkpoints treat them alike:

* `ReplicatedAdamW` (ZeRO-0): the weights are the fp32 master copy; every replica keeps the whole
  AdamW state — 16 bytes per weight (4 weight, 4 gradient, 8 moments).
* `ShardedAdamW` level 1 (ZeRO-1): the weights live in one flat buffer of the compute type (2
  bytes in bf16), the gradients accumulate in one flat fp32 buffer (4), reduce-scattered in place
  over the stage's data-parallel group (as DeepSpeed's stage 1 and Megatron's distributed
  optimizer do: the traffic of ZeRO-0's all-reduce; over gloo an all-reduce, `sum_into_shard`);
  each replica keeps an fp32 master copy and AdamW's moments of its 1/dp of that buffer (12/dp),
  steps it, and the new weights are all-gathered in place — 2 + 4 + 12/dp.
* level 2 (ZeRO-2): the gradients accumulate in the compute type (2) and are reduce-scattered
  into each replica's fp32 shard (4/dp) — 2 + 2 + 16/dp, the same traffic. In a pipeline a
  stage's gradients build up over every micro-batch of the step, so the full buffer lives through
  the step either way; what sharding saves is its width, at the price of accumulating in bf16.

The flat buffer is padded to a multiple of dp, so every shard has the same size and the bytes are
exactly `static_bytes` (the planner's `pipeloom.static_memory`). Sharding is elementwise and
AdamW is elementwise, so a sharded step is the unsharded one. The collectives are torch's
(`reduce_scatter_single`, `all_gather_single`) over the device's data-parallel group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.runtime.gradients import GradientStore
from pipeloom.runtime.optimizer_sync import adamw_rollback, step_under

__all__ = [
    "JointSteppers",
    "ReplicatedAdamW",
    "ShardedAdamW",
    "adamw",
    "adamw_slot",
    "squares_and_bad",
    "sum_into_shard",
]
_CHUNK = 1 << 22
"""Elements per reduce-scatter piece: the fp32 copy it needs stays small beside the buffer."""


class ReplicatedAdamW:
    """ZeRO-0: AdamW over every weight this rank holds, on every replica."""

    level = 0

    def __init__(self, parameters: Sequence[nn.Parameter], owned: Callable[[nn.Parameter], bool], lr: float) -> None:
        self.parameters = list(parameters)
        self.owned = [p for p in self.parameters if owned(p)]
        self.optimizer = adamw(self.parameters, lr) if self.parameters else None

    def zero_grad(self) -> None:
        for parameter in self.parameters:
            parameter.grad = None

    def reduce(self) -> None:
        """The data-parallel sum is part of the gradient buckets here."""

    def local_state(self) -> torch.Tensor:
        return squares_and_bad([p.grad for p in self.owned if p.grad is not None], self._device)

    def owned_gradients(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(parameter, its gradient) of those this rank counts in the global norm."""
        return [(p, p.grad) for p in self.owned if p.grad is not None]

    def scale(self, factor: float | torch.Tensor) -> None:
        grads = [parameter.grad for parameter in self.parameters if parameter.grad is not None]
        if grads:
            torch._foreach_mul_(grads, factor)

    def step(self, decision: torch.Tensor | None = None) -> None:
        """AdamW's step; skipped on the device where `decision` ([stepped, coefficient]) says so."""
        if self.optimizer is not None:
            step_under(self.optimizer, decision)

    def rollback(self) -> None:
        if self.optimizer is not None:
            adamw_rollback(self.optimizer)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters)

    @property
    def optimizer_bytes(self) -> int:
        """AdamW's two moments, as allocated (the weights are the master copy)."""
        return _state_bytes(self.optimizer) if self.optimizer is not None else 0

    @property
    def gradient_bytes(self) -> int:
        return sum(p.grad.numel() * p.grad.element_size() for p in self.parameters if p.grad is not None)

    def checkpoint_state(
        self, keys: dict[int, str], masters: bool = False, by_name: bool = False
    ) -> dict[str, torch.Tensor]:
        """AdamW's state of every weight by its name (the weights are their own masters)."""
        state: dict[str, torch.Tensor] = {}
        if self.optimizer is None:
            return state
        for parameter in self.parameters:
            slot = adamw_slot(self.optimizer, parameter)
            for field in ("step", "exp_avg", "exp_avg_sq"):
                state[f"optim.{keys[id(parameter)]}.{field}"] = slot[field]
        return state

    def after_load(self) -> None:
        """The weights are the master copy: nothing to restore from."""

    @property
    def _device(self) -> torch.device:
        return self.parameters[0].device if self.parameters else torch.device("cpu")


class ShardedAdamW:
    """ZeRO-1/2 over the data-parallel `group` of this rank's device (see the module docstring).
    Built from the fp32 weights, which it then casts to `weight_dtype` in place."""

    def __init__(
        self,
        parameters: Sequence[nn.Parameter],
        owned: Callable[[nn.Parameter], bool],
        lr: float,
        level: int,
        group: dist.ProcessGroup,
        weight_dtype: torch.dtype,
        label: str,
    ) -> None:
        assert level in (1, 2), level
        self.level, self.group, self.label = level, group, label
        self.size = dist.get_world_size(group)
        self.index = dist.get_group_rank(group, dist.get_rank())
        self.parameters = list(parameters)
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        total = sum(p.numel() for p in self.parameters)
        self.shard = math.ceil(total / self.size) if total else 0
        begin, end = self.index * self.shard, (self.index + 1) * self.shard
        master = torch.zeros(self.shard, dtype=torch.float32, device=device)
        mask = torch.zeros(self.shard, dtype=torch.bool, device=device)
        self.weights = torch.zeros(self.shard * self.size, dtype=weight_dtype, device=device)
        """Every weight, in the compute type: the parameters are views of it, so the new shards
        are all-gathered straight into them."""
        offset = 0
        with torch.no_grad():
            for parameter in self.parameters:
                low, high = max(offset, begin), min(offset + parameter.numel(), end)
                if low < high:
                    master[low - begin : high - begin] = parameter.detach().reshape(-1)[low - offset : high - offset]
                    mask[low - begin : high - begin] = owned(parameter)
                view = self.weights[offset : offset + parameter.numel()].view_as(parameter)
                view.copy_(parameter.detach())
                parameter.data = view
                offset += parameter.numel()
        self.owned_mask = mask
        """Elements of the shard whose parameter this device counts in the global norm."""
        self.master = nn.Parameter(master)
        self.optimizer = adamw([self.master], lr)
        self.store = GradientStore(self.parameters, torch.float32 if level == 1 else weight_dtype, self.size)
        # ZeRO-1 reduce-scatters the fp32 buffer in place: the shard's gradient is its own slice.
        own = self.store.flat[begin:end]
        self.master_grad = own if level == 1 else torch.zeros_like(master)
        self.master.grad = self.master_grad  # AdamW reads it there
        self.ranges: dict[int, tuple[int, int]] = {}
        """Stage → its elements of the flat buffer, for the sums started under the pipeline."""
        self.early: set[int] = set()
        self._started: dict[int, list] = {}
        self._loading: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        """During a load by name: each weight with its whole master and moments, until `after_load`
        keeps the shard's ranges of them."""
        self._loading_step = torch.zeros(())

    def zero_grad(self) -> None:
        self.store.zero()
        self._started.clear()

    def overlap(self, ranges: dict[int, tuple[int, int]], early: set[int]) -> None:
        """Let ZeRO-1's sum of each stage's gradients (`ranges`: stage → its elements of the flat
        buffer) start as soon as the stage's last backward has run (`start`), under the pipeline —
        the `early` ones: a stage whose weights other ranks of the replica also hold (a tie)
        waits for that sum first, after the pipeline."""
        if self.level == 1:
            self.ranges, self.early = dict(ranges), set(early)

    def start(self, stages: Sequence[int]) -> list[int]:
        """Start summing these stages' gradients over the replicas, asynchronously; returns the
        stages it started."""
        started = [stage for stage in stages if stage in self.early and stage not in self._started]
        for stage in started:
            self._started[stage] = self._sum_range(*self.ranges[stage], wait=False)
        return started

    def _sum_range(self, low: int, high: int, wait: bool) -> list:
        """ZeRO-1's sum of elements low..high of the buffer into the shards that hold them: over
        gloo an all-reduce of them (as `sum_into_shard`), else a reduce of each shard's part to
        the replica that owns it (a reduce-scatter in pieces)."""
        flat, works = self.store.flat, []
        if dist.get_backend(self.group) == "gloo":
            works.append(dist.all_reduce(flat[low:high], group=self.group, async_op=not wait))
        else:
            for owner in range(self.size):
                begin, end = max(low, owner * self.shard), min(high, (owner + 1) * self.shard)
                if begin < end:
                    destination = dist.get_global_rank(self.group, owner)
                    works.append(dist.reduce(flat[begin:end], destination, group=self.group, async_op=not wait))
        return [work for work in works if work is not None]

    def reduce(self) -> None:
        """The data-parallel sum, into this replica's shard of the gradient."""
        flat, begin = self.store.flat, self.index * self.shard
        if not self.shard:
            return
        if self.level == 1 and self._started:  # some stages' sums are in flight: the rest by range
            for stage, (low, high) in self.ranges.items():
                if stage not in self._started:
                    self._sum_range(low, high, wait=True)
            for works in self._started.values():
                for work in works:
                    work.wait()
            self._started.clear()
            return
        if self.level == 1:
            sum_into_shard(flat, flat[begin : begin + self.shard], self.group)
            return
        rows = flat.view(self.size, self.shard)
        for low in range(0, self.shard, _CHUNK):
            high = min(low + _CHUNK, self.shard)
            piece = rows[:, low:high].float().contiguous().view(-1)  # rank r's part is row r
            dist.reduce_scatter_single(self.master_grad[low:high], piece, group=self.group)

    def local_state(self) -> torch.Tensor:
        """[squares, non-finite count] of the owned elements, summed over the group's shards."""
        grad = self.master_grad
        finite = torch.isfinite(grad)
        counted = self.owned_mask
        squares = torch.where(finite & counted, grad, torch.zeros_like(grad)).double().pow(2).sum()
        bad = (~finite & counted).sum().double()
        state = torch.stack((squares, bad))
        dist.all_reduce(state, group=self.group)
        return state

    def scale(self, factor: float | torch.Tensor) -> None:
        self.master_grad.mul_(factor)

    def step(self, decision: torch.Tensor | None = None) -> None:
        step_under(self.optimizer, decision)
        self._gather_weights()

    def rollback(self) -> None:
        adamw_rollback(self.optimizer)
        self._gather_weights()

    def _gather_weights(self) -> None:
        """Every replica's new shard, in the weights' type, into the weights (in place)."""
        if not self.shard:
            return
        begin = self.index * self.shard
        own = self.weights[begin : begin + self.shard]
        own.copy_(self.master.detach())
        dist.all_gather_single(self.weights, own, group=self.group)

    @property
    def optimizer_bytes(self) -> int:
        """The fp32 master shard and its two moments, as allocated."""
        return self.master.numel() * self.master.element_size() + _state_bytes(self.optimizer)

    @property
    def weight_bytes(self) -> int:
        return self.weights.numel() * self.weights.element_size()

    @property
    def gradient_bytes(self) -> int:
        """The accumulation buffer, and under ZeRO-2 the fp32 shard it is reduce-scattered into."""
        shard = self.master_grad.numel() * self.master_grad.element_size() if self.level == 2 else 0
        return self.store.bytes + shard

    def checkpoint_state(
        self, keys: dict[int, str], masters: bool = False, by_name: bool = False
    ) -> dict[str, torch.Tensor]:
        """The shard's master weights and moments (what a resume on this layout reads). With
        `masters` (a save) also every weight's fp32 master and moments by its name in the whole
        model, as a replicated optimizer keeps them (`master.NAME`, `optim.NAME.*`: what `export`
        writes and any other layout resumes from) — gathered over the group, a collective, with a
        transient fp32 copy of the rank's weights and moments. With `by_name` (a load of another
        layout's checkpoint) only those, into transient whole tensors whose owned ranges
        `after_load` keeps."""
        slot = adamw_slot(self.optimizer, self.master)
        if by_name:

            def zeros_as(parameter: nn.Parameter) -> torch.Tensor:
                return torch.zeros(parameter.shape, dtype=torch.float32, device=self.master.device)

            self._loading = [(p, zeros_as(p), zeros_as(p), zeros_as(p)) for p in self.parameters]
            self._loading_step = torch.zeros_like(slot["step"])
            state = {}
            for parameter, master, exp_avg, exp_avg_sq in self._loading:
                key = keys[id(parameter)]
                state[f"master.{key}"] = master
                state[f"optim.{key}.exp_avg"], state[f"optim.{key}.exp_avg_sq"] = exp_avg, exp_avg_sq
                state[f"optim.{key}.step"] = self._loading_step
            return state
        prefix = f"zero.{self.label}.shard{self.index}"
        state = {
            f"{prefix}.master": self.master.data,
            **{f"{prefix}.{field}": slot[field] for field in ("step", "exp_avg", "exp_avg_sq")},
        }
        if not self.shard or not masters:
            return state
        wholes = []
        for part in (self.master.detach(), slot["exp_avg"], slot["exp_avg_sq"]):
            whole = torch.empty(self.shard * self.size, dtype=torch.float32, device=self.master.device)
            dist.all_gather_single(whole, part.contiguous(), group=self.group)
            wholes.append(whole)
        offset = 0
        for parameter in self.parameters:
            key, span = keys[id(parameter)], slice(offset, offset + parameter.numel())
            master, exp_avg, exp_avg_sq = (whole[span].view(parameter.shape) for whole in wholes)
            state[f"master.{key}"] = master
            state[f"optim.{key}.exp_avg"], state[f"optim.{key}.exp_avg_sq"] = exp_avg, exp_avg_sq
            state[f"optim.{key}.step"] = slot["step"]
            offset += parameter.numel()
        return state

    def after_load(self) -> None:
        """The loaded master shards are the truth; the weights follow from them. Loaded by name
        (another layout's checkpoint), the shard's ranges are cut from the whole tensors first."""
        if self._loading:
            slot = adamw_slot(self.optimizer, self.master)
            begin, end = self.index * self.shard, (self.index + 1) * self.shard
            offset = 0
            with torch.no_grad():
                for parameter, *wholes in self._loading:
                    low, high = max(offset, begin), min(offset + parameter.numel(), end)
                    if low < high:
                        for target, whole in zip((self.master, slot["exp_avg"], slot["exp_avg_sq"]), wholes):
                            target[low - begin : high - begin] = whole.reshape(-1)[low - offset : high - offset]
                    offset += parameter.numel()
                slot["step"].copy_(self._loading_step)
            self._loading = []
        self._gather_weights()


class JointSteppers:
    """Several optimizers of one rank stepped as one — the host's (offloaded stages) and the
    device's, or under expert parallelism with ZeRO the dense weights' (sharded over the
    replicas) and the experts' (over the replicas holding the same experts) — so clipping,
    skipping, the loss scale, post-validation, checkpoints and the byte counts treat them alike."""

    def __init__(self, *parts) -> None:
        self.parts = parts

    def leaves(self) -> list:
        """The optimizers themselves, nested joints flattened."""
        return [leaf for part in self.parts for leaf in (part.leaves() if isinstance(part, JointSteppers) else [part])]

    @property
    def weight_bytes(self) -> int:
        return sum(part.weight_bytes for part in self.parts)

    @property
    def gradient_bytes(self) -> int:
        return sum(part.gradient_bytes for part in self.parts)

    @property
    def optimizer_bytes(self) -> int:
        return sum(part.optimizer_bytes for part in self.parts)

    def checkpoint_state(
        self, keys: dict[int, str], masters: bool = False, by_name: bool = False
    ) -> dict[str, torch.Tensor]:
        return {k: v for part in self.parts for k, v in part.checkpoint_state(keys, masters, by_name).items()}

    def after_load(self) -> None:
        for part in self.parts:
            part.after_load()

    def zero_grad(self) -> None:
        for part in self.parts:
            part.zero_grad()

    def reduce(self) -> None:
        for part in self.parts:
            part.reduce()

    def local_state(self) -> torch.Tensor:
        return sum(part.local_state() for part in self.parts)

    def scale(self, factor: float | torch.Tensor) -> None:
        for part in self.parts:
            part.scale(factor)

    def step(self, decision: torch.Tensor | None = None) -> None:
        for part in self.parts:
            part.step(decision)

    def rollback(self) -> None:
        for part in self.parts:
            part.rollback()


def sum_into_shard(flat: torch.Tensor, shard: torch.Tensor, group: dist.ProcessGroup | None = None) -> None:
    """The data-parallel sum of `flat` into `shard`, this rank's slice of it, in place. gloo's
    reduce-scatter runs slower than its all-reduce of the whole buffer: for 22 MB of fp32 here
    28–29 ms against 19.5–19.8 ms at dp = 2 (30 against 23 ms at dp = 3, 53 against 42 ms at
    dp = 4, two cores shared), so over gloo the buffer is all-reduced and the shard read from
    its slice; NCCL's reduce-scatter moves half the all-reduce's bytes and runs as itself.
    `profile.links` times this function as the profile's `reduce_scatter`."""
    if dist.get_backend(group) == "gloo":
        dist.all_reduce(flat, group=group)
    else:
        dist.reduce_scatter_single(shard, flat, group=group)


def adamw(parameters: Sequence[torch.Tensor], lr: float) -> torch.optim.AdamW:
    """torch's AdamW, fused: one pass over each weight and its moments, with no temporaries. The
    default (foreach) made fresh buffers of the shard's size each step, so its first steps on a
    rank faulted their pages in (16 000, 8 000 and 5 000 faults, 60, 40 and 40 ms for a
    2.75 M-element shard here) and later ones now and then again; fused, a step took 2.0 ms
    against 5.5–10 (2.75 M elements) and 3.6 against 12.7 (5.5 M)."""
    return torch.optim.AdamW(parameters, lr=lr, fused=True)


def adamw_slot(optimizer: torch.optim.AdamW, parameter: torch.Tensor) -> dict:
    """AdamW's state of `parameter`, created zeroed (as its first step would) if it has none yet,
    so a checkpoint can save it or load into it in place."""
    slot = optimizer.state[parameter]
    if not slot:
        slot.update(
            step=torch.tensor(0.0),
            exp_avg=torch.zeros_like(parameter, memory_format=torch.preserve_format),
            exp_avg_sq=torch.zeros_like(parameter, memory_format=torch.preserve_format),
        )
    return slot


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """AdamW's moments (its step counters are scalars, left out)."""
    return sum(
        value.numel() * value.element_size()
        for slot in optimizer.state.values()
        for key, value in slot.items()
        if key != "step" and isinstance(value, torch.Tensor)
    )


def squares_and_bad(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """[sum of squares of the finite gradients, how many are not finite], on `device`, from one
    norm per tensor (`torch._foreach_norm`): nothing is read on the host, nothing copied."""
    grads = [grad.detach() for grad in grads]
    if not grads:
        return torch.zeros(2, dtype=torch.float64, device=device)
    norms = torch.stack(torch._foreach_norm(grads)).double()
    finite = torch.isfinite(norms)
    squares = torch.where(finite, norms, torch.zeros_like(norms)).pow(2).sum()
    return torch.stack((squares, (~finite).sum().double())).to(device)
