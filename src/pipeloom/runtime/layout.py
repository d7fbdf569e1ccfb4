"""Where each rank sits on the pp × dp × tp grid, and the one DeviceMesh over it.

Ranks are numbered as Megatron and torchtitan number them, tensor parallelism innermost: the `tp`
ranks of one stage's group are consecutive (one node's GPUs under torchrun), then the
data-parallel replicas of that device, then the pipeline devices. Every process group the runtime
makes — p2p pairs, gradient buckets, ZeRO's data-parallel groups, the tensor-parallel group —
follows from `rank(replica, device, tp_index)`; expert parallelism groups consecutive replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLayout"]


@dataclass(frozen=True)
class RankLayout:
    devices: int
    """Pipeline devices of one replica (the schedule's `num_devices`)."""
    dp: int = 1
    tp: int = 1

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
