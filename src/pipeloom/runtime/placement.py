"""Where each weight lives: one record per parameter a rank holds (`WeightPlacement`) — its name
and shape in the whole model, how the tensor- and expert-parallel groups cut it (DTensor's own
placement types: `Shard(dim)` or `Replicate()`), whether its gradient on a tensor-parallel rank
is only a part of the sum, who counts it in the global gradient norm, and which optimizer keeps
its state — on every replica, ZeRO-sharded over all the data-parallel replicas or over those that
hold the same experts, or on the host.

Every feature that asks "who owns this shard" reads the record (`WeightPlacements`): the global
norm of clipping, post-validation and fp16's overflow skip (`counted`, `expert`), the split of
the optimizers (`optimizer`), checkpoints (`as_dtensor`: a shard saved as its part of the whole
weight under its name), and results and export (`whole`: gathered over the group that cut it).
The cutters (`tensor_parallel_styles.shard_stages`, `expert_parallel.shard_experts`) write what
they cut into their groups; the record is read off them once, after the cut.

Why a record of placements rather than DTensor parameters: the stages compute on plain local
shards — the B/W split's deferred weight gradients (`split_linear`), the experts' routed GEMMs and
the tensor-parallel styles' region collectives all take plain tensors, and ZeRO's flat buffers
hold views of them — so the parameters stay plain tensors and a shard becomes a DTensor (of the
record's placements, on its group's mesh) only where a library reads placements: the checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from pipeloom.ir.schedule import Schedule

__all__ = ["ModelWeights", "WeightPlacement", "WeightPlacements"]

OPTIMIZERS = ("replicas", "dp", "edp", "host")
"""Where a weight's optimizer state lives: whole on every replica (ZeRO-0), ZeRO-sharded over the
data-parallel replicas or (an expert slice) over the replicas holding the same experts, or on
the host (an offloaded stage)."""


@dataclass(frozen=True)
class WeightPlacement:
    name: str
    """In the whole model (`models.workload.global_names`; a tied weight: where it first appears)."""
    shape: tuple[int, ...]
    """The whole weight's."""
    local_shape: tuple[int, ...]
    """What this rank holds."""
    tp: Placement = Replicate()
    """Over the tensor-parallel group."""
    tp_blocks: int = 1
    """Packed blocks along the tp shard's dimension (GPT-2's q, k, v), each cut apart."""
    ep: Placement = Replicate()
    """Over the expert-parallel group: `Shard(0)` for a slice of the stacked experts."""
    partial_over_tp: bool = False
    """A replicated weight whose gradient each tensor-parallel rank took from its sequence shard
    only (sequence parallelism): summed over the group before the optimizer."""
    counted: bool = False
    """Whether this rank counts it in the global gradient norm."""
    optimizer: str = "replicas"
    """Where its optimizer state lives (`OPTIMIZERS`)."""

    @property
    def expert(self) -> bool:
        return isinstance(self.ep, Shard)

    @property
    def counted_numel(self) -> int:
        """The elements this rank adds to the global norm."""
        return math.prod(self.local_shape) if self.counted else 0

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "local_shape": list(self.local_shape),
            "tp": str(self.tp),
            "ep": str(self.ep),
            "partial_over_tp": self.partial_over_tp,
            "counted": self.counted,
            "optimizer": self.optimizer,
        }


class ModelWeights:
    """Every weight of the whole model by its name, read before the stages are cut: where it
    first appears (ties share that name), its whole shape, and the pipeline device that counts
    it in the global norm — the lowest hosting its first stage."""

    def __init__(self, schedule: Schedule, all_stages: Sequence[nn.Module], names: dict[int, dict[str, str]]) -> None:
        counter = {
            s: min(d for d in range(schedule.num_devices) if s in schedule.stages_on(d))
            for s in range(schedule.num_stages)
        }
        self.canonical: dict[str, str] = {}
        """A parameter's name in a stage → its name where it first appears."""
        self.shape: dict[str, tuple[int, ...]] = {}
        self.counter: dict[str, int] = {}
        first: dict[int, str] = {}
        for s, module in enumerate(all_stages):
            for local, parameter in module.named_parameters():
                name = names[s][local]
                canonical = first.setdefault(id(parameter), name)
                self.canonical[name] = canonical
                self.shape.setdefault(canonical, tuple(parameter.shape))
                self.counter.setdefault(canonical, counter[s])

    def place(
        self,
        stages: dict[int, nn.Module],
        names: dict[int, dict[str, str]],
        device: int,
        tensor=None,
        experts=None,
        zero: int = 0,
        offload_stages: Sequence[int] = (),
    ) -> WeightPlacements:
        """The record of what `stages` (this rank's, cut) hold: `tensor` and `experts` are this
        rank's groups (`TensorParallel`, `ExpertExchange`; None: not cut over one)."""
        tp_cut = tensor.sharded if tensor is not None else {}
        partial = tensor.partial if tensor is not None else set()
        first_of_group = tensor is None or tensor.index == 0
        expert_ids = experts.sharded if experts is not None else set()
        on_host = {id(t) for s in offload_stages if s in stages for t in stages[s].parameters()}
        records: dict[int, WeightPlacement] = {}
        for s, module in stages.items():
            for local, parameter in module.named_parameters():
                if id(parameter) in records:
                    continue
                name = self.canonical[names[s][local]]
                cut = tp_cut.get(id(parameter))
                expert = id(parameter) in expert_ids
                if id(parameter) in on_host:
                    optimizer = "host"
                elif zero:
                    optimizer = "edp" if expert else "dp"
                else:
                    optimizer = "replicas"
                records[id(parameter)] = WeightPlacement(
                    name=name,
                    shape=self.shape[name],
                    local_shape=tuple(parameter.shape),
                    tp=Shard(cut[0]) if cut is not None else Replicate(),
                    tp_blocks=cut[1] if cut is not None else 1,
                    ep=Shard(0) if expert else Replicate(),
                    partial_over_tp=id(parameter) in partial,
                    counted=self.counter[name] == device and (first_of_group or cut is not None),
                    optimizer=optimizer,
                )
        return WeightPlacements(records, tensor, experts)


class WeightPlacements:
    """This rank's record (by parameter), and what the features ask of it."""

    def __init__(self, records: dict[int, WeightPlacement], tensor=None, experts=None) -> None:
        self._records = records
        self._tensor, self._experts = tensor, experts

    def __getitem__(self, parameter: torch.Tensor) -> WeightPlacement:
        return self._records[id(parameter)]

    def __contains__(self, parameter: torch.Tensor) -> bool:
        return id(parameter) in self._records

    def records(self) -> list[WeightPlacement]:
        return sorted(self._records.values(), key=lambda record: record.name)

    def counted(self, parameter: torch.Tensor) -> bool:
        """Whether this rank counts `parameter` in the global norm: on the device that counts
        it, every tensor-parallel rank its own shard and the group's first rank a replicated
        weight; an expert slice by every rank of its expert-parallel group (which hold the
        layer's experts between them), summed over that group (`expert`)."""
        return self._records[id(parameter)].counted

    def expert(self, parameter: torch.Tensor) -> bool:
        return self._records[id(parameter)].expert

    def as_dtensor(self, parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (the parameter's data, an optimizer moment or master of its shape) as this
        rank's shard of one DTensor of the whole weight, sharing its storage — what
        torch.distributed.checkpoint saves under the weight's name and reads back into any other
        cut; a weight no group cuts, as it is."""
        record = self._records.get(id(parameter))
        if record is None:
            return value
        if isinstance(record.tp, Shard) and self._tensor is not None:
            return DTensor.from_local(value, self._tensor.mesh, [record.tp], run_check=False)
        if record.expert and self._experts is not None and self._experts.mesh is not None:
            return DTensor.from_local(value, self._experts.mesh, [record.ep], run_check=False)
        return value

    def whole(self, parameter: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """`value` (the parameter, its gradient, an optimizer moment) as one process would hold
        it: gathered over the group that cut it — a collective every rank of that group calls in
        the same order (a weight is cut over one group at most)."""
        record = self._records.get(id(parameter))
        if record is None:
            return value
        if isinstance(record.tp, Shard) and self._tensor is not None:
            dim = record.tp.dim
            mesh = self._tensor.mesh
            return torch.cat(
                [
                    DTensor.from_local(block.contiguous(), mesh, [record.tp], run_check=False).full_tensor()
                    for block in value.chunk(record.tp_blocks, dim)
                ],
                dim,
            )
        if record.expert and self._experts is not None:
            parts = [torch.empty_like(value) for _ in range(self._experts.size)]
            dist.all_gather(parts, value.contiguous(), group=self._experts.group)
            return torch.cat(parts)
        return value
