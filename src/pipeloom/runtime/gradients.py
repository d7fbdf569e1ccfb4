"""Summing gradients over every copy of a parameter: data-parallel replicas, Chimera's second
pipeline, and parameters shared between stages (tied input and output embeddings).

A parameter's copies live on the ranks that host any stage using it. Every rank builds the whole
model (on the meta device), so each knows which stages share a parameter object (a tie) and which
devices host each stage; parameters with the same set of holder ranks and the same stages using
them form one bucket, all-reduced as one flat fp32 tensor (their gradients are views of it:
`GradientBuckets.keep_in_place`) in a group of exactly those ranks, started as soon as those
stages' last backward of the step has run on the rank (`GradientBuckets.watch`) — as Megatron
sums the embedding's gradient over the first and last pipeline ranks before the optimizer. Two stages of one rank that share a parameter hold one object, whose
gradient autograd already summed; it is reduced once. Under ZeRO the buckets sum only the copies
within a replica (ties, Chimera's second pipeline) and the optimizer does the data-parallel sum
itself (`pipeloom.runtime.zero`). Under expert parallelism a routed expert's copies are the
replicas that hold the same slice of experts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.runtime.layout import RankLayout

__all__ = [
    "Bucket",
    "GradientBuckets",
    "GradientStore",
    "grad_of",
    "reduce_in_process",
    "tie_groups",
    "unique_parameters",
]


def grad_of(parameter: nn.Parameter) -> torch.Tensor | None:
    """A parameter's accumulated gradient: its fp32 `main_grad` when its weights are kept in the
    compute type (`pipeloom.runtime.zero`), else `.grad`."""
    main = getattr(parameter, "main_grad", None)
    return main if main is not None else parameter.grad


def unique_parameters(modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Parameters of `modules` in order, each shared one once."""
    seen: set[int] = set()
    out = []
    for module in modules:
        for parameter in module.parameters():
            if id(parameter) not in seen:
                seen.add(id(parameter))
                out.append(parameter)
    return out


def tie_groups(stages: Sequence[nn.Module]) -> list[list[tuple[int, str]]]:
    """(stage, parameter name) of every parameter object that more than one stage holds."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for stage, module in enumerate(stages):
        for name, parameter in module.named_parameters(remove_duplicate=False):
            places = holders.setdefault(id(parameter), [])
            if all(s != stage for s, _ in places):
                places.append((stage, name))
    return [places for places in holders.values() if len(places) > 1]


class GradientStore:
    """The gradients of `parameters` as views of one flat buffer of `dtype`, padded to a multiple
    of `multiple`. A parameter of that dtype accumulates straight into its view (its `.grad`);
    one of another type (bf16 weights, fp32 gradients) gets a `main_grad` view that a hook adds
    each freshly accumulated `.grad` into, freeing it at once."""

    def __init__(self, parameters: Sequence[nn.Parameter], dtype: torch.dtype, multiple: int = 1) -> None:
        self.parameters = list(parameters)
        total = sum(p.numel() for p in self.parameters)
        self.numel = total
        padded = math.ceil(total / multiple) * multiple if total else 0
        device = self.parameters[0].device if self.parameters else torch.device("cpu")
        self.flat = torch.zeros(padded, dtype=dtype, device=device)
        self.views: dict[int, torch.Tensor] = {}
        self.offsets: list[tuple[nn.Parameter, int]] = []
        offset = 0
        for parameter in self.parameters:
            view = self.flat[offset : offset + parameter.numel()].view_as(parameter)
            self.views[id(parameter)] = view
            self.offsets.append((parameter, offset))
            offset += parameter.numel()
            if parameter.dtype != dtype:
                # Megatron's name for the fp32 gradient of a weight kept in the compute type
                parameter.main_grad = view  # type: ignore[attr-defined]
                parameter.register_post_accumulate_grad_hook(_fold_into_main_grad)
        self.zero()

    def zero(self) -> None:
        self.flat.zero_()
        for parameter in self.parameters:
            view = self.views[id(parameter)]
            parameter.grad = view if parameter.dtype == view.dtype else None

    def grad_of(self, parameter: nn.Parameter) -> torch.Tensor:
        return self.views[id(parameter)]

    @property
    def bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


def _fold_into_main_grad(parameter: nn.Parameter) -> None:
    if parameter.grad is not None:  # None when the weight's gradient waits for W (SplitLinear)
        parameter.main_grad.add_(parameter.grad)  # type: ignore[attr-defined]
        parameter.grad = None


@dataclass
class Bucket:
    """Parameters summed over one group of ranks as one flat fp32 tensor."""

    group: dist.ProcessGroup | None
    ranks: list[int]
    parameters: list[nn.Parameter]
    stages: frozenset[int] = frozenset()
    """The stages (of the whole model) that use its parameters: their gradients are final once
    each of those this rank hosts has run its last backward of the step. Empty: summed after
    the pipeline (sequence parallelism's second sum, which needs the first)."""
    work: dist.Work | None = None
    """Its all-reduce in flight, started under the pipeline."""
    summed: torch.Tensor | None = None
    """What that all-reduce sums into, when it is a copy (not the store's buffer)."""

    @property
    def key(self) -> tuple:
        return tuple(self.ranks), tuple(sorted(self.stages))


class GradientBuckets:
    """This rank's part of the plan; built identically (same group order) on every rank.

    A bucket holds the parameters with the same holders and the same stages using them, so that
    it can start its all-reduce (asynchronously) as soon as the rank has run the last backward
    of each of those stages it hosts (`watch`), under the later stages' work — as DDP's buckets
    and Megatron's overlapped grad reduce do; `reduce` then waits for what is in flight and sums
    the rest."""

    def __init__(
        self,
        schedule: Schedule,
        dp: int,
        all_stages: Sequence[nn.Module],
        rank: int,
        across_replicas: bool = True,
        new_group: Callable[[list[int]], dist.ProcessGroup | None] = dist.new_group,
        layout: RankLayout | None = None,
        experts: Collection[int] = (),
        ep: int = 1,
    ) -> None:
        """`experts`: ids of the routed experts' parameters, whose copies under expert
        parallelism are the replicas of one EP index (dp / ep of them), not all dp replicas."""
        layout = layout or RankLayout(schedule.num_devices, dp)
        p = schedule.num_devices
        spans = [range(dp)] if across_replicas else [[replica] for replica in range(dp)]
        users: dict[int, set[int]] = {}
        for stage, module in enumerate(all_stages):
            for parameter in module.parameters():
                users.setdefault(id(parameter), set()).add(stage)
        by_key: dict[tuple[tuple[int, ...], tuple[int, ...]], list[tuple[int, str]]] = {}
        # The buckets of tensor-parallel index t hold ranks of index t: each sums copies of one shard.
        for replicas, t in ((replicas, t) for t in range(layout.tp) for replicas in spans):
            stage_ranks = {
                s: {layout.rank(replica, d, t) for replica in replicas for d in range(p) if s in schedule.stages_on(d)}
                for s in range(schedule.num_stages)
            }
            # A logical parameter: its first (stage, name); its holders: every rank hosting a user.
            logical: dict[int, tuple[tuple[int, str], set[int]]] = {}
            for stage, module in enumerate(all_stages):
                for name, parameter in module.named_parameters(remove_duplicate=False):
                    key, ranks = logical.setdefault(id(parameter), ((stage, name), set()))
                    ranks |= stage_ranks[stage]
            for identity, (key, holders) in logical.items():
                copies = [holders]
                if ep > 1 and identity in experts:  # EP index j holds experts j·E/ep..: its copies
                    copies = [{r for r in holders if layout.coords(r)[0] % ep == j} for j in range(ep)]
                for ranks in copies:
                    by_key.setdefault((tuple(sorted(ranks)), tuple(sorted(users[identity]))), []).append(key)
        self.buckets: list[Bucket] = []
        self.stores: dict[int, GradientStore] = {}
        """By bucket index: the buckets whose gradients are views of one buffer (`keep_in_place`)."""
        lookup = {
            (s, n): prm for s, m in enumerate(all_stages) for n, prm in m.named_parameters(remove_duplicate=False)
        }
        for (members, stages), keys in sorted(by_key.items()):
            if len(members) < 2:
                continue
            group = new_group(list(members))  # every rank creates every group, in this order
            if rank in members:
                self.buckets.append(
                    Bucket(group, list(members), [lookup[key] for key in sorted(keys)], frozenset(stages))
                )
        self._last_backward: dict[Op, int] = {}
        self._then: Callable[[Sequence[int]], list[int]] | None = None
        self._hosted: set[int] = set()
        self._finished: set[int] = set()
        self.started: list[tuple[tuple[int, ...], float]] = []
        """This step's sums started under the pipeline: (a bucket's stages, or the stage whose
        ZeRO sum it is; when: `time.perf_counter`)."""

    def rebind(self, shards: dict[int, nn.Parameter]) -> None:
        """After this rank's stages were cut over their tensor-parallel group: each bucket sums
        this rank's shard (`shards`: full parameter by id → shard) of the parameters it holds."""
        for bucket in self.buckets:
            bucket.parameters = [shards.get(id(p), p) for p in bucket.parameters]

    def sum_over(self, group: dist.ProcessGroup | None, members: list[int], parameters: list[nn.Parameter]) -> None:
        """One more bucket: `parameters` summed over `group` (sequence parallelism's replicated
        weights, whose gradient each tensor-parallel rank took from its sequence shard only),
        after the pipeline and the buckets before it."""
        if parameters and len(members) > 1:
            self.buckets.append(Bucket(group, members, parameters))

    def keep_in_place(self, held: Collection[int] = ()) -> None:
        """Once the buckets are final (after `rebind` and `sum_over`): each bucket whose parameters
        no other buffer holds gets its gradients as views of one flat fp32 `GradientStore`, as
        DDP's bucket views and Megatron's contiguous buffer do, so its all-reduce runs in place.
        Concatenating into a fresh tensor and copying back cost 4 ms a step for the decoder's
        22 MB when the pages were reused and 13–20 ms when they were fresh. A bucket with a
        parameter already in a buffer (`held`: ids of an offloaded stage's host store, ZeRO's
        sharded store) or in an earlier bucket (sequence parallelism's replicated weights, summed
        over the replicas and then over the tensor-parallel group) keeps the copying path."""
        taken = set(held)
        for index, bucket in enumerate(self.buckets):
            ids = {id(parameter) for parameter in bucket.parameters}
            if ids & taken:
                continue
            self.stores[index] = GradientStore(bucket.parameters, torch.float32)
            taken |= ids

    def watch(
        self, schedule: Schedule, device: int, then: Callable[[Sequence[int]], list[int]] | None = None
    ) -> Callable[[Sequence[Op]], None]:
        """What the executor calls after each op it ran (`DeviceExecutor.after_ops`): a stage's
        last backward op of the step (its last B, W or BW on this device) starts the all-reduce
        of every bucket all of whose hosted stages are then done, and `then` (ZeRO's sum over
        the replicas) is told which stages have just finished, and says which it started."""
        self._then = then
        self._hosted = set(schedule.stages_on(device))
        last: dict[int, Op] = {}
        for op in schedule.devices[device]:
            if op.kind in (OpKind.B, OpKind.W, OpKind.BW):
                last[op.stage] = op
        self._last_backward = {op: stage for stage, op in last.items()}
        return self._after_ops

    def _after_ops(self, ops: Sequence[Op]) -> None:
        stages = [self._last_backward[op] for op in ops if op in self._last_backward]
        if not stages:
            return
        self._finished.update(stages)
        for index, bucket in enumerate(self.buckets):
            hosted = bucket.stages & self._hosted
            if bucket.work is None and hosted and hosted <= self._finished:
                began = time.perf_counter()  # when the executor started it, as ZeRO's below: not after
                # gloo's launch, which on a busy host can outlast the stage's remaining ops
                flat = self.flat(index)
                bucket.work = dist.all_reduce(flat, group=bucket.group, async_op=True)
                bucket.summed = flat if index not in self.stores else None
                self.started.append((tuple(sorted(bucket.stages)), began))
        if self._then is not None:
            now = time.perf_counter()
            self.started.extend(((stage,), now) for stage in self._then(stages))

    def zero(self) -> None:
        """A step's start, after the optimizer let go of the gradients: the views, zeroed."""
        self._finished.clear()
        self.started = []
        for store in self.stores.values():
            store.zero()

    def reduce(self) -> None:
        """After the pipeline: wait for the all-reduces in flight and run the others, in order."""
        for index, bucket in enumerate(self.buckets):
            if bucket.work is not None:
                bucket.work.wait()
                flat, bucket.work, bucket.summed = bucket.summed, None, None
            else:
                flat = self.flat(index)
                dist.all_reduce(flat, group=bucket.group)
            if flat is not None and index not in self.stores:
                self.assign(index, flat)

    def flat(self, index: int) -> torch.Tensor:
        """Bucket `index`'s gradients as one fp32 tensor (a missing gradient counts as zeros): its
        store's buffer itself when it has one, else a concatenated copy."""
        if index in self.stores:
            return self.stores[index].flat
        parameters = self.buckets[index].parameters
        for parameter in parameters:
            if grad_of(parameter) is None:
                parameter.grad = torch.zeros_like(parameter)
        return torch.cat([_grad(parameter).reshape(-1).float() for parameter in parameters])

    def assign(self, index: int, flat: torch.Tensor) -> None:
        """Write a bucket's summed gradients back into its parameters."""
        if index in self.stores:
            self.stores[index].flat.copy_(flat)
            return
        offset = 0
        for parameter in self.buckets[index].parameters:
            size = parameter.numel()
            _grad(parameter).copy_(flat[offset : offset + size].view_as(parameter))
            offset += size

    def describe(self) -> list[list[int]]:
        return [bucket.ranks for bucket in self.buckets]


def _grad(parameter: nn.Parameter) -> torch.Tensor:
    grad = grad_of(parameter)
    assert grad is not None, "flat() gave every parameter of a bucket a gradient"
    return grad


def reduce_in_process(per_rank: Sequence[GradientBuckets]) -> None:
    """Every rank's buckets summed in this process, as the all-reduces of the ranks would: a
    bucket's holders built it identically, so its flats line up; the sum runs in rank order."""
    by_key: dict[tuple, list[tuple[GradientBuckets, int]]] = {}
    for buckets in per_rank:
        for index, bucket in enumerate(buckets.buckets):
            by_key.setdefault(bucket.key, []).append((buckets, index))
    for holders in by_key.values():
        flats = [buckets.flat(index) for buckets, index in holders]
        total = flats[0].clone()
        for flat in flats[1:]:
            total += flat
        for buckets, index in holders:
            buckets.assign(index, total)
