"""Where each rank sits on the pp × dp × tp grid, and the one DeviceMesh over it.

Ranks are numbered as Megatron and torchtitan number them, tensor parallelism innermost: the `tp`
ranks of one stage's group are consecutive (one node's GPUs under torchrun), then the
data-parallel replicas of that device, then the pipeline devices. Every process group the runtime
makes — p2p pairs, gradient buckets, ZeRO's data-parallel groups, the tensor-parallel group —
follows from `rank(replica, device, tp_index)`.
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
