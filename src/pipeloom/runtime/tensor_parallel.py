"""Tensor and sequence parallelism inside a stage: Megatron's layout on torch's DTensor.

A stage's linears are split over the `tp` ranks of its tensor-parallel group as Megatron splits
them: column-parallel in (each rank computes some heads, some MLP columns), row-parallel out
(partial sums, reduced), a vocabulary-parallel embedding and head, and the loss taken over the
vocabulary shards with torch's `loss_parallel` (no rank ever holds all logits). Under sequence
parallelism the norms and residuals between those regions run on a sequence shard each: the
column-parallel input all-gathers the sequence and the row-parallel output reduce-scatters it
(instead of one all-reduce each way).

Which module is which comes from the model (`Workload.tp_plan`: transformers'
`base_model_tp_plan` where the library has one); `parallelize_module` walks the plan and applies a
`ParallelStyle` per module, over the mesh's `tp` dimension. Every collective is a DTensor
redistribution — `from_local` / `redistribute` / `to_local(grad_placements=...)`, so autograd
carries its conjugate into the backward (an all-reduce forward is a copy backward, an all-gather
forward a reduce-scatter backward).

What does not come from torch, and why: torch's `ColwiseParallel` / `RowwiseParallel` turn the
weights into DTensor parameters. Here the weights stay plain tensors holding this rank's shard,
and only the activations pass through DTensor at the region boundaries, because everything after
the forward works on plain local tensors: the B/W split (`split_linear`: the weight-gradient GEMM
of a row- or column-parallel linear is local to the shard, so W needs no communication and must
not pay DTensor's dispatch per GEMM), the flat gradient buckets, ZeRO's flat weight and
gradient buffers, host offload. Shards are cut with `distribute_tensor` (the library's cut), and a
checkpoint wraps them back as DTensors (`runtime.checkpoint`), which torch.distributed.checkpoint
saves as shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, loss_parallel, parallelize_module

from pipeloom.errors import ConfigError
from pipeloom.models.workload import TensorParallelPlan
from pipeloom.runtime.boundary import TensorSpec
from pipeloom.runtime.split_linear import SplitLinear, split_linears

__all__ = [
    "TensorParallel",
    "enter_region",
    "leave_region",
    "gather_sequence",
    "scatter_sequence",
    "parallelize_stage",
    "shard_stages",
    "wire_boundaries",
    "parallel_loss",
    "loss_parallel",
]

_SEQUENCE = 1  # (batch, sequence, hidden): the dimension sequence parallelism shards


@dataclass
class TensorParallel:
    """This rank's tensor-parallel group (the mesh's `tp` dimension) and the options of the run."""

    mesh: DeviceMesh
    sequence_parallel: bool = False
    shards: dict[int, nn.Parameter] = field(default_factory=dict)
    """Full parameter (by id) → its shard on this rank, so a tied weight stays one object."""
    sharded: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Shard parameter (by id) → (the dimension it is cut along, packed blocks); the rest are
    replicated."""
    full_of: dict[int, torch.Tensor] = field(default_factory=dict)
    """Shard parameter (by id) → the full parameter it was cut from."""
    sent_bytes: int = 0
    """Bytes this rank sent in the group's collectives since the step began, as a ring moves
    them: 2(tp−1)/tp of an all-reduced tensor, (tp−1)/tp of an all-gathered or reduce-scattered
    one — counted when the forward runs, its backward's too when autograd will run one."""

    def count(self, tensor: torch.Tensor, *collectives: str, backward: tuple[str, ...] = ()) -> None:
        """Book the collectives of a region boundary on `tensor`, the whole (unsharded) activation."""
        names = collectives + (backward if torch.is_grad_enabled() and tensor.requires_grad else ())
        share = (self.size - 1) / self.size
        whole = tensor.numel() * tensor.element_size()
        self.sent_bytes += int(sum(whole * share * (2 if name == "allreduce" else 1) for name in names))

    @property
    def size(self) -> int:
        return self.mesh.size()

    @property
    def index(self) -> int:
        return self.mesh.get_local_rank()

    def shard(self, parameter: torch.Tensor, dim: int, parts: int = 1) -> nn.Parameter:
        """This rank's shard of `parameter` along `dim`; with `parts` > 1 the dimension holds that
        many packed blocks (GPT-2's fused q, k, v), each cut separately."""
        known = self.shards.get(id(parameter))
        if known is not None:
            return known
        full = parameter.detach()
        if full.shape[dim] % (parts * self.size):
            raise ConfigError(
                f"--tp {self.size}: a weight of shape {tuple(full.shape)} cannot be cut into {self.size} along "
                f"dimension {dim}" + (f" ({parts} packed blocks)" if parts > 1 else "")
            )
        blocks = full.chunk(parts, dim)
        local = torch.cat(
            [distribute_tensor(b, self.mesh, [Shard(dim)], src_data_rank=None).to_local() for b in blocks], dim
        )
        shard = nn.Parameter(local.clone(), requires_grad=parameter.requires_grad)
        self.shards[id(parameter)] = shard
        self.sharded[id(shard)] = (dim, parts)
        self.full_of[id(shard)] = parameter
        return shard

    def full(self, parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Collective over the group: `value` (the parameter itself, its gradient, an optimizer
        moment) whole, as one process would hold it."""
        cut = self.sharded.get(id(parameter))
        if cut is None:
            return value
        dim, parts = cut
        blocks = value.chunk(parts, dim)
        return torch.cat(
            [
                DTensor.from_local(b.contiguous(), self.mesh, [Shard(dim)], run_check=False).full_tensor()
                for b in blocks
            ],
            dim,
        )

    def as_shard(self, parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (the parameter's data or an optimizer moment) as this rank's shard of one
        DTensor, sharing its storage — what torch.distributed.checkpoint saves and loads into."""
        cut = self.sharded.get(id(parameter))
        if cut is None:
            return value
        return DTensor.from_local(value, self.mesh, [Shard(cut[0])], run_check=False)


# -- the collectives at region boundaries, each with its conjugate in the backward ---------------


def enter_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Into a column-parallel linear: the full input on every rank (a copy, or under sequence
    parallelism an all-gather of the sequence); backward: the partial input gradients summed
    (all-reduce, or reduce-scatter back to the sequence shards)."""
    if tp.sequence_parallel:
        whole = _redistribute(x, tp, Shard(_SEQUENCE), Replicate()).to_local(grad_placements=[Partial()])
        tp.count(whole, "all_gather", backward=("reduce_scatter",))
        return whole
    tp.count(x, backward=("allreduce",))
    return DTensor.from_local(x, tp.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def leave_region(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Out of a row-parallel linear: the partial sums reduced (all-reduce, or reduce-scatter to
    the sequence shards); backward: the output gradient to every rank (a copy, or all-gather)."""
    if tp.sequence_parallel:
        tp.count(y, "reduce_scatter", backward=("all_gather",))
        return _redistribute(y, tp, Partial(), Shard(_SEQUENCE)).to_local()
    tp.count(y, "allreduce")
    return _redistribute(y, tp, Partial(), Replicate()).to_local()


def gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A replicated activation rebuilt from the sequence shards the ranks received; backward: each
    rank's shard of the (identical) gradient."""
    whole = _redistribute(x, tp, Shard(_SEQUENCE), Replicate()).to_local()
    tp.count(whole, "all_gather")
    return whole


def scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's sequence shard of a replicated activation (what it sends on, so the group sends
    each byte once); backward: the shards' gradients all-gathered."""
    tp.count(x, backward=("all_gather",))
    return _redistribute(x, tp, Replicate(), Shard(_SEQUENCE)).to_local()


def _redistribute(x: torch.Tensor, tp: TensorParallel, held: Placement, wanted: Placement) -> DTensor:
    return DTensor.from_local(x, tp.mesh, [held], run_check=False).redistribute(tp.mesh, [wanted])


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
        tp, target = self.tp, [Shard(_SEQUENCE) if self.scatter else Replicate()]
        module.weight = tp.shard(module.weight, 0)
        rows = module.weight.shape[0]
        padding = module.padding_idx
        local_padding = None if padding is None else padding - tp.index * rows
        if local_padding is not None and not 0 <= local_padding < rows:
            local_padding = None

        def forward(ids: torch.Tensor) -> torch.Tensor:
            weight = module.weight
            if local_padding is not None:  # the padding row's gradient stays zero, as nn.Embedding's
                keep = torch.ones(rows, 1, dtype=weight.dtype, device=weight.device)
                keep[local_padding] = 0
                weight = weight * keep + (weight * (1 - keep)).detach()
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


def wire_boundaries(boundaries: Sequence[tuple[TensorSpec, ...]], tp: int) -> list[tuple[TensorSpec, ...]]:
    """What one tensor-parallel rank sends and receives at each stage boundary: its sequence shard
    of every floating tensor (the data, index 0, comes whole from the batch)."""
    out = [tuple(boundaries[0])]
    for specs in boundaries[1:]:
        out.append(
            tuple(
                TensorSpec((spec.shape[0], spec.shape[1] // tp, *spec.shape[2:]), spec.dtype)
                if spec.floating and len(spec.shape) > 1
                else spec
                for spec in specs
            )
        )
    return out


def parallel_loss(loss: Callable[[object, object], torch.Tensor]) -> Callable[[object, object], torch.Tensor]:
    """The model's loss over vocabulary-sharded logits (under `loss_parallel`, which the backward
    must run in too), as a plain tensor."""

    def local_loss(output, targets) -> torch.Tensor:
        with loss_parallel():
            value = loss(output, targets)
        return value.to_local() if isinstance(value, DTensor) else value

    return local_loss


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
    parallelize_module(stage, tp.mesh, {pattern: _style(role, tp) for pattern, role in present.items()})
    _rebind_shards(stage, tp)
    _cut_boundaries(stage, tp, first, last)
    if not tp.sequence_parallel:
        return []
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
