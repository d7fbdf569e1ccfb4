"""The styles that cut a stage over its tensor-parallel group, and the stage cut by its plan.

`parallelize_stage` applies a model's plan (module path → role) with torch's `parallelize_module`;
each role is a `ParallelStyle` whose weights stay plain local shards (why: `tensor_parallel`) and
whose activations cross the region boundaries through `tensor_parallel`'s collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from pipeloom.errors import ConfigError
from pipeloom.models.workload import TensorParallelPlan
from pipeloom.runtime.split_linear import SplitLinear, split_linears
from pipeloom.runtime.tensor_parallel import (
    SEQUENCE,
    TensorParallel,
    enter_region,
    gather_sequence,
    leave_region,
    scatter_sequence,
)

__all__ = ["ROLES", "parallelize_stage", "shard_stages"]


# -- the styles ---------------------------------------------------------------------------------


def _linear_dims(module: nn.Module) -> tuple[int, int]:
    """(output dimension, input dimension) of a linear's weight: (0, 1) for nn.Linear, (1, 0) for
    a transposed one (transformers' Conv1D, or a SplitLinear made from one)."""
    transposed = getattr(module, "transposed", False) or type(module).__name__ == "Conv1D"
    return (1, 0) if transposed else (0, 1)


def _as_split(module: nn.Module) -> SplitLinear:
    if not isinstance(module, SplitLinear):
        raise ConfigError(f"tensor parallelism: {type(module).__name__} is not a linear layer")
    return module


class _Style(ParallelStyle):
    def __init__(self, tp: TensorParallel) -> None:
        super().__init__()
        self.tp = tp


class Colwise(_Style):
    """Output features split: each rank computes its columns (heads, MLP columns) from the full
    input, which the enclosing block's `RegionInput` made; `parts` > 1 for a fused projection whose
    output packs that many blocks."""

    def __init__(self, tp: TensorParallel, parts: int = 1) -> None:
        super().__init__(tp)
        self.parts = parts

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer, tp = _as_split(module), self.tp
        out_dim, _ = _linear_dims(layer)
        layer.weight = tp.shard(layer.weight, out_dim, self.parts)
        if layer.bias is not None:
            layer.bias = tp.shard(layer.bias, 0, self.parts)
        return layer


class RegionInput(_Style):
    """A block (attention, MLP) whose column-parallel linears all read its input: the input enters
    the region once, whole (`enter_region`) — the attention reshapes by the sequence length it
    sees, so under sequence parallelism the gather must come before the block, not inside it."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = self.tp

        def enter(_, args: tuple, kwargs: dict):
            if args:
                return (enter_region(args[0], tp), *args[1:]), kwargs
            return args, {**kwargs, "hidden_states": enter_region(kwargs["hidden_states"], tp)}

        module.register_forward_pre_hook(enter, with_kwargs=True)
        return module


class Rowwise(_Style):
    """Input features split: each rank multiplies its slice and the partial sums are reduced; the
    bias is added once, after the reduction."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer, tp = _as_split(module), self.tp
        _, in_dim = _linear_dims(layer)
        layer.weight = tp.shard(layer.weight, in_dim)
        layer.add_bias = False

        def reduce(mod: SplitLinear, _, out: torch.Tensor) -> torch.Tensor:
            out = leave_region(out, tp)
            return out + mod.bias.to(out.dtype) if mod.bias is not None else out

        layer.register_forward_hook(reduce)
        return layer


class VocabEmbedding(_Style):
    """Rows of the vocabulary split: DTensor's embedding over a Shard(0) table looks up the ids this
    rank holds (zeros elsewhere) and the partial rows are reduced — to every rank, or to the
    sequence shards (`scatter`)."""

    def __init__(self, tp: TensorParallel, scatter: bool) -> None:
        super().__init__(tp)
        self.scatter = scatter

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            raise ConfigError(f"tensor parallelism: {type(module).__name__} is not an embedding")
        tp, target = self.tp, [Shard(SEQUENCE) if self.scatter else Replicate()]
        module.weight = tp.shard(module.weight, 0)
        rows = module.weight.shape[0]
        padding = None if module.padding_idx is None else module.padding_idx - tp.index * rows

        def forward(ids: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if padding is not None and 0 <= padding < rows:
                # the padding row's gradient stays zero, as nn.Embedding's (not the tied head's)
                row = weight[padding : padding + 1].detach()
                weight = torch.cat((weight[:padding], row, weight[padding + 1 :]))
            table = DTensor.from_local(weight, tp.mesh, [Shard(0)], run_check=False)
            found = nn.functional.embedding(DTensor.from_local(ids, tp.mesh, [Replicate()], run_check=False), table)
            tp.count(found, "reduce_scatter" if self.scatter else "allreduce")
            return cast(DTensor, found).redistribute(tp.mesh, target).to_local()

        module.forward = forward  # type: ignore[method-assign,assignment]
        return module


class VocabHead(Colwise):
    """The LM head, column-parallel over the vocabulary, entering the region itself; its output
    stays a DTensor sharded on the vocabulary, for the loss under `loss_parallel`."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        layer = super()._apply(module, device_mesh)
        tp, mesh = self.tp, self.tp.mesh
        layer.register_forward_pre_hook(lambda _, args: (enter_region(args[0], tp), *args[1:]))
        layer.register_forward_hook(lambda _, __, out: DTensor.from_local(out, mesh, [Shard(-1)], run_check=False))
        return layer


class ScatterAfter(_Style):
    """A module that runs on the full sequence (BERT's embeddings: positions, token types and a
    norm after the lookup) whose output then goes on as sequence shards."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = self.tp
        module.register_forward_hook(lambda _, __, out: scatter_sequence(out, tp))
        return module


# -- a stage ------------------------------------------------------------------------------------


ROLES = (
    "region_input",
    "colwise",
    "rowwise",
    "packed_colwise3",
    "vocab_embedding",
    "vocab_embedding_replicated",
    "vocab_head",
    "scatter_after",
)
"""What a model's tensor-parallel plan may call a module."""


SUMMED = "replicated_summed"
"""A plan's role for a replicated weight whose gradient each rank computes from its own part (a
norm over each attention head): summed over the group with the gradient buckets."""


def _style(role: str, tp: TensorParallel) -> ParallelStyle:
    match role:
        case "region_input":
            return RegionInput(tp)
        case "colwise":
            return Colwise(tp)
        case "packed_colwise3":
            return Colwise(tp, parts=3)
        case "rowwise":
            return Rowwise(tp)
        case "vocab_embedding":
            return VocabEmbedding(tp, scatter=tp.sequence_parallel)
        case "vocab_embedding_replicated":
            return VocabEmbedding(tp, scatter=False)
        case "vocab_head":
            return VocabHead(tp)
        case "scatter_after":
            return ScatterAfter(tp)
    raise ConfigError(f"tensor parallelism: unknown role {role!r} in the model's plan (known: {', '.join(ROLES)})")


def packs_projections(work, tp: int, sequence_parallel: bool) -> bool:
    """Whether `work`'s model, cut over `tp` ranks, has a weight packing several projections
    (GPT-2's q, k, v): its shards are blocks of each, not one slice of the whole weight."""
    if tp == 1 or work.tensor_parallel is None:
        return False
    return any(role.startswith("packed") for role in work.tensor_parallel(tp, sequence_parallel).modules.values())


def shard_stages(
    stages: dict[int, nn.Module], plan: TensorParallelPlan, tp: TensorParallel, num_stages: int
) -> list[nn.Parameter]:
    """Cut this rank's stages over its tensor-parallel group, in place; return the replicated
    parameters whose gradients must be summed over the group (`parallelize_stage`)."""
    partial: list[nn.Parameter] = []
    for s, module in stages.items():
        for parameter in parallelize_stage(module, plan.modules, tp, s == 0, s == num_stages - 1, plan.full_sequence):
            if all(parameter is not p for p in partial):
                partial.append(parameter)
        if plan.adjust is not None:
            plan.adjust(module, tp.size, tp.index, tp.sequence_parallel)
    return partial


def parallelize_stage(
    stage: nn.Module,
    plan: dict[str, str],
    tp: TensorParallel,
    first: bool,
    last: bool,
    full_sequence: Sequence[str] = (),
) -> list[nn.Parameter]:
    """Apply the model's plan (module path pattern → role) to one stage, in place, and cut its
    boundaries so each rank sends only its sequence shard; return the replicated parameters whose
    gradients are partial on each rank (under sequence parallelism: those that see only a
    shard — every replicated one but those under `full_sequence` modules), to be summed over the
    group."""
    _split_all_linears(stage)
    names = {name for name, _ in stage.named_modules()}
    present = {pattern: role for pattern, role in plan.items() if any(_matches(pattern, n) for n in names)}
    styled = {pattern: _style(role, tp) for pattern, role in present.items() if role != SUMMED}
    parallelize_module(stage, tp.mesh, styled)
    _rebind_shards(stage, tp)
    _cut_boundaries(stage, tp, first, last)
    summed = [  # replicated weights applied to each rank's own heads (Qwen3's q/k norms)
        p
        for pattern, role in present.items()
        if role == SUMMED
        for name, module in stage.named_modules()
        if _matches(pattern, name)
        for p in module.parameters()
    ]
    if not tp.sequence_parallel:
        return list({id(p): p for p in summed}.values())
    kept = {
        id(p)
        for prefix in full_sequence
        for name, m in stage.named_modules()
        if _matches(prefix, name)
        for p in m.parameters()
    }
    seen: set[int] = set()
    partial = []
    for parameter in stage.parameters():
        if id(parameter) in tp.sharded or id(parameter) in kept or id(parameter) in seen:
            continue
        seen.add(id(parameter))
        partial.append(parameter)
    return partial


def _rebind_shards(stage: nn.Module, tp: TensorParallel) -> None:
    """Every other reference to a cut parameter (a tie: BERT's decoder bias is also its head's
    `bias`) points to the shard too, so no module keeps the full tensor."""
    for module in stage.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            shard = tp.shards.get(id(parameter))
            if shard is not None:
                setattr(module, name, shard)


def _matches(pattern: str, name: str) -> bool:
    parts, names = pattern.split("."), name.split(".")
    return len(parts) == len(names) and all(p == "*" or p == n for p, n in zip(parts, names))


def _split_all_linears(module: nn.Module) -> None:
    """Every linear a SplitLinear (without a queue, autograd computes its weight gradient) so the
    styles handle one kind of layer; those already split for W keep their queue."""
    split_linears(module, None)


def _cut_boundaries(stage: nn.Module, tp: TensorParallel, first: bool, last: bool) -> None:
    """Without sequence parallelism a stage's input and output are replicated over the group: it
    sends its shard of the output and all-gathers its input from the shards. Under sequence
    parallelism they are shards already."""
    if tp.sequence_parallel:
        return

    def gather(inputs: tuple) -> tuple:
        return tuple(gather_sequence(t, tp) if t.is_floating_point() else t for t in inputs)

    def scatter(out):
        if isinstance(out, torch.Tensor):
            return scatter_sequence(out, tp) if out.is_floating_point() else out
        return tuple(scatter_sequence(t, tp) if t.is_floating_point() else t for t in out)

    if not first:
        stage.register_forward_pre_hook(lambda _, args: gather(args))
    if not last:
        stage.register_forward_hook(lambda _, __, out: scatter(out))
    split = getattr(stage, "split_at", None)
    if split is not None:

        def split_at(count: int) -> tuple[Callable, Callable]:
            head, tail = split(count)
            wrapped_head = head if first else (lambda *x: head(*gather(x)))
            wrapped_tail = tail if last else (lambda *x: scatter(tail(*x)))
            return wrapped_head, wrapped_tail

        stage.split_at = split_at  # type: ignore[method-assign,assignment]
