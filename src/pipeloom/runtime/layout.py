"""Where each rank sits on the pp × dp × cp × tp grid, and the one DeviceMesh over it.

Ranks are numbered as Megatron and torchtitan number them, tensor parallelism innermost: the `tp`
ranks of one stage's group are consecutive (one node's GPUs under torchrun), then the
context-parallel ranks, then the data-parallel replicas of that device, then the pipeline
devices. A context-parallel rank holds the same weights as the data-parallel replicas do, so the
grid's "replicas" are dp × cp — the copies of each weight that sum their gradients and share
ZeRO's shards, replica r being data-parallel replica r // cp and context shard r % cp. Every
process group the runtime makes — p2p pairs, gradient buckets, ZeRO's data-parallel groups, the
tensor- and context-parallel groups — follows from `rank(replica, device, tp_index)`; expert
parallelism groups consecutive replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    devices: int
    """Pipeline devices of one replica (the schedule's `num_devices`)."""
    dp: int = 1
    """Replicas of each weight: data-parallel × context-parallel ranks."""
    tp: int = 1
    cp: int = 1
    """Context-parallel ranks among the replicas: consecutive ones read the same samples."""

    @property
    def world_size(self) -> int:
        return self.devices * self.dp * self.tp

    def rank(self, replica: int, device: int, tp_index: int = 0) -> int:
        return (device * self.dp + replica) * self.tp + tp_index

    def coords(self, rank: int) -> tuple[int, int, int]:
        """(replica, device, tp index) of `rank`."""
        rest, tp_index = divmod(rank, self.tp)
        device, replica = divmod(rest, self.dp)
        return replica, device, tp_index

    def samples_of(self, replica: int) -> tuple[int, int]:
        """(data-parallel replica, context shard) of a replica: which samples it reads, and which
        part of their sequence."""
        return divmod(replica, self.cp)

    def context_mesh(self, device_type: str):
        """The same ranks with the replicas split into dp × cp: dimensions pp, dp, cp, tp, whose
        `cp` dimension is each stage's context-parallel group."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.devices, self.dp // self.cp, self.cp, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "dp", "cp", "tp"))

    def mesh(self, device_type: str):
        """The run's DeviceMesh, dimensions named pp, dp, tp (torch.distributed must be up)."""
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, (self.devices, self.dp, self.tp), mesh_dim_names=("pp", "dp", "tp"))

    def expert_mesh(self, device_type: str, ep: int):
        """The same ranks with each device's replicas cut into groups of `ep` (DeepSeek's and
        torchtitan's expert parallelism borrowed from data parallelism): dimensions pp, edp (the
        groups), ep, tp. Replica r is EP rank r % ep of group r // ep, so `rank` is unchanged."""
        from torch.distributed.device_mesh import init_device_mesh

        shape = (self.devices, self.dp // ep, ep, self.tp)
        return init_device_mesh(device_type, shape, mesh_dim_names=("pp", "edp", "ep", "tp"))
