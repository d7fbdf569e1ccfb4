"""Tensor and sequence parallelism inside a stage: Megatron's layout on torch's DTensor.

A stage's linears are split over the `tp` ranks of its tensor-parallel group as Megatron splits
them: column-parallel in (each rank computes some heads, some MLP columns), row-parallel out
(partial sums, reduced), a vocabulary-parallel embedding and head, and the loss taken over the
vocabulary shards with torch's `loss_parallel` (no rank ever holds all logits). Under sequence
parallelism the norms and residuals between those regions run on a sequence shard each: the
column-parallel input all-gathers the sequence and the row-parallel output reduce-scatters it
(instead of one all-reduce each way).

Which module is which comes from the model (`Workload.tensor_parallel`: transformers'
`base_model_tp_plan` where the library has one); `tensor_parallel_styles.parallelize_stage` walks
the plan with `parallelize_module`, a `ParallelStyle` per module, over the mesh's `tp` dimension.
This module holds the group and its collectives. Every collective is a DTensor
redistribution — `from_local` / `redistribute` / `to_local(grad_placements=...)`, so autograd
carries its conjugate into the backward (an all-reduce forward is a copy backward, an all-gather
forward a reduce-scatter backward).

What does not come from torch, and why: torch's `ColwiseParallel` / `RowwiseParallel` turn the
weights into DTensor parameters. Here the weights stay plain tensors holding this rank's shard,
and only the activations pass through DTensor at the region boundaries, because everything after
the forward works on plain local tensors: the B/W split (`split_linear`: the weight-gradient GEMM
of a row- or column-parallel linear is local to the shard, so W needs no communication and must
not pay DTensor's dispatch per GEMM), the flat gradient buckets, ZeRO's flat weight and
gradient buffers, host offload. Shards are cut as `Shard(dim)` places them (torch.chunk), on the
meta device before any weight is real (`pipeloom.models.materialise`), and a checkpoint wraps them back as DTensors (`runtime.checkpoint`), which torch.distributed.checkpoint
saves as shards.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard
from torch.distributed.tensor.parallel import loss_parallel

from pipeloom.errors import ConfigError
from pipeloom.models.materialise import Cut
from pipeloom.runtime.boundary import TensorSpec

__all__ = [
    "TensorParallel",
    "enter_region",
    "leave_region",
    "gather_sequence",
    "scatter_sequence",
    "wire_boundaries",
    "parallel_loss",
    "loss_parallel",
]

SEQUENCE = 1  # (batch, sequence, hidden): the dimension sequence parallelism shards


@dataclass
class TensorParallel:
    """This rank's tensor-parallel group (the mesh's `tp` dimension) and the options of the run."""

    mesh: DeviceMesh
    sequence_parallel: bool = False
    shards: dict[int, nn.Parameter] = field(default_factory=dict)
    """During set-up: full parameter (by id) → its shard on this rank, so a tied weight stays one
    object."""
    sharded: dict[int, tuple[int, int]] = field(default_factory=dict)
    """Shard parameter (by id) → (the dimension it is cut along, packed blocks); the rest are
    replicated (what `placement.ModelWeights.place` reads)."""
    partial: set[int] = field(default_factory=set)
    """Replicated parameters (by id) whose gradients each rank takes from its sequence shard only."""
    cuts: dict[int, tuple[torch.Tensor, Cut]] = field(default_factory=dict)
    """During set-up: a shard cut on the meta device (by id) → (the meta parameter it was cut
    from, how), for `materialise` to read or initialise its values."""
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
        cut = Cut(dim, self.index, self.size, parts)
        local = cut.of(full)
        shard = nn.Parameter(
            torch.empty_like(local) if full.is_meta else local.clone(), requires_grad=parameter.requires_grad
        )
        self.shards[id(parameter)] = shard
        self.sharded[id(shard)] = (dim, parts)
        if full.is_meta:
            self.cuts[id(shard)] = (parameter, cut)
        return shard

    def set_up_done(self) -> None:
        """Forget the full parameters the shards were cut from."""
        self.shards.clear()
        self.cuts.clear()


# -- the collectives at region boundaries, each with its conjugate in the backward ---------------


def enter_region(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Into a column-parallel linear: the full input on every rank (a copy, or under sequence
    parallelism an all-gather of the sequence); backward: the partial input gradients summed
    (all-reduce, or reduce-scatter back to the sequence shards)."""
    if tp.sequence_parallel:
        whole = _redistribute(x, tp, Shard(SEQUENCE), Replicate()).to_local(grad_placements=[Partial()])
        tp.count(whole, "all_gather", backward=("reduce_scatter",))
        return whole
    tp.count(x, backward=("allreduce",))
    return DTensor.from_local(x, tp.mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def leave_region(y: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """Out of a row-parallel linear: the partial sums reduced (all-reduce, or reduce-scatter to
    the sequence shards); backward: the output gradient to every rank (a copy, or all-gather)."""
    if tp.sequence_parallel:
        tp.count(y, "reduce_scatter", backward=("all_gather",))
        return _redistribute(y, tp, Partial(), Shard(SEQUENCE)).to_local()
    tp.count(y, "allreduce")
    return _redistribute(y, tp, Partial(), Replicate()).to_local()


def gather_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A replicated activation rebuilt from the sequence shards the ranks received; backward: each
    rank's shard of the (identical) gradient."""
    whole = _redistribute(x, tp, Shard(SEQUENCE), Replicate()).to_local()
    tp.count(whole, "all_gather")
    return whole


def scatter_sequence(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """This rank's sequence shard of a replicated activation (what it sends on, so the group sends
    each byte once); backward: the shards' gradients all-gathered."""
    tp.count(x, backward=("all_gather",))
    return _redistribute(x, tp, Replicate(), Shard(SEQUENCE)).to_local()


def _redistribute(x: torch.Tensor, tp: TensorParallel, held: Placement, wanted: Placement) -> DTensor:
    return DTensor.from_local(x, tp.mesh, [held], run_check=False).redistribute(tp.mesh, [wanted])


# -- what crosses a stage boundary, and the loss ---------------------------------------------


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
    """The model's loss over vocabulary-sharded logits, as a plain tensor; the executor runs it,
    and the backward from it, under `loss_parallel` (its loss context)."""

    def local_loss(output, targets) -> torch.Tensor:
        value = loss(output, targets)
        return value.to_local() if isinstance(value, DTensor) else value

    return local_loss
