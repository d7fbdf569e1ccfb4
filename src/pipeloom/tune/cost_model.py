"""Costs of a concrete plan — layers per stage, micro-batch size, dp — in milliseconds and bytes.

`AnalyticCostModel` derives them from a model and a hardware preset (`analytic`); the profiler
writes a `ProfiledCostModel` measured on this machine (`pipeloom.tune.profiled`). Both answer the
same questions, so the tuner does not care where the numbers come from:

* per-stage Costs for a partition (what the simulator needs), including T-Offload's bytes;
* per-layer and end-stage times and memory, for the partitioner;
* what a step adds after the pipeline: the data-parallel gradient all-reduce, the optimizer and
  the runtime's own overhead (the batch, zeroing gradients, the loss all-reduce).

Static memory and those step additions depend on the ZeRO level (`zero`, see
`pipeloom.static_memory`): ZeRO-1/2 shrink the optimizer state by dp at the price of an
all-gather of the new weights; M_offload is what offloading a stage's optimizer takes off the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pipeloom.costs import Costs
from pipeloom.static_memory import collective_bytes, offload_saving, static_bytes
from pipeloom.tune.analytic import (
    all_to_all_bytes,
    head_figures,
    layer_figures,
    stage_input_bytes,
    static_bytes_per_param,
)
from pipeloom.tune.presets import HardwareSpec, ModelSpec

__all__ = ["CostModel", "AnalyticCostModel", "ADAM_FLOPS_PER_PARAM"]

ADAM_FLOPS_PER_PARAM = 16
"""Arithmetic of one AdamW update per weight (moments, bias correction, decay, step)."""


class CostModel(Protocol):
    model: ModelSpec
    source: str
    """Where the numbers come from: a hardware preset's name, or "profile"."""

    def stage_costs(
        self, counts: Sequence[int], micro_batch: int, pp: int, dp: int, zero: int = 0, slices: int = 1
    ) -> Costs: ...

    def layer_time(self, micro_batch: int) -> float: ...

    def end_times(self, micro_batch: int) -> tuple[float, float]: ...

    def layer_memory(self, micro_batch: int, dp: int, zero: int = 0) -> tuple[float, float]: ...

    def stage_params(self, counts: Sequence[int]) -> list[float]: ...

    def expert_params(self, counts: Sequence[int]) -> list[float]:
        """Of `stage_params`, the routed experts' (a rank's num_experts / EP of them): their
        gradients are summed over only the replicas that hold the same experts."""
        ...

    def allreduce_time(self, params: float, pp: int, dp: int, zero: int = 0) -> float: ...

    def optimizer_time(self, params: float, dp: int, zero: int = 0) -> float: ...

    def gather_time(self, params: float, pp: int, dp: int) -> float: ...

    def step_overhead_time(self) -> float: ...

    def replica_skew(self, dp: int, zero: int = 0) -> float: ...

    @property
    def sync_overlaps_compute(self) -> bool:
        """Whether a stage's gradient sync, started as its last backward ends, runs beside the
        device's later ops (`measures.StaticOption.stage_sync`) or takes their time."""
        ...

    def to_dict(self) -> dict: ...

    def __hash__(self) -> int: ...  # the tuner caches stage costs per model (`measures`)


@dataclass(frozen=True)
class AnalyticCostModel:
    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1

    @property
    def source(self) -> str:
        return self.hardware.name

    def _ms(self, flops: float) -> float:
        return 1e3 * flops / (self.hardware.peak_flops * self.hardware.efficiency)

    def layer_time(self, micro_batch: int) -> float:
        layer = layer_figures(self.model, micro_batch, self.tp)
        return self._ms(layer.forward_flops + layer.backward_flops + layer.weight_flops)

    def end_times(self, micro_batch: int) -> tuple[float, float]:
        """Extra time of the first stage (embedding: a lookup) and the last (head and loss)."""
        head = head_figures(self.model, micro_batch, self.tp)
        return 0.0, self._ms(head.forward_flops + head.backward_flops + head.weight_flops)

    def layer_memory(self, micro_batch: int, dp: int, zero: int = 0) -> tuple[float, float]:
        """(activation bytes, static bytes) of one layer."""
        layer = layer_figures(self.model, micro_batch, self.tp)
        return layer.activation_bytes, layer.params * static_bytes_per_param(dp, zero)

    def expert_params(self, counts: Sequence[int]) -> list[float]:
        return [n * self.model.stored_expert_params / self.tp for n in counts]

    def stage_params(self, counts: Sequence[int]) -> list[float]:
        layer = self.model.stored_layer_params / self.tp
        embedding = self.model.vocab * self.model.hidden / self.tp
        last = len(counts) - 1
        return [n * layer + embedding * ((i == 0) + (i == last)) for i, n in enumerate(counts)]

    def stage_costs(
        self, counts: Sequence[int], micro_batch: int, pp: int, dp: int, zero: int = 0, slices: int = 1
    ) -> Costs:
        """Per-stage costs of whole micro-batches; a schedule with `slices` shares them out
        (FLOPs and bytes scale with the tokens), so `slices` changes nothing here."""
        layer = layer_figures(self.model, micro_batch, self.tp)
        head = head_figures(self.model, micro_batch, self.tp)
        last = len(counts) - 1

        def per_stage(per_layer: float, on_last: float) -> list[float]:
            return [n * per_layer + (on_last if i == last else 0.0) for i, n in enumerate(counts)]

        params = self.stage_params(counts)
        hw = self.hardware
        forward = per_stage(self._ms(layer.forward_flops), self._ms(head.forward_flops))
        a2a_per_layer = self.all_to_all_time(micro_batch)
        a2a = per_stage(a2a_per_layer, 0.0) if a2a_per_layer else 0.0  # dense: the key stays unset
        return Costs(
            F=forward,
            B=per_stage(self._ms(layer.backward_flops), self._ms(head.backward_flops)),
            W=per_stage(self._ms(layer.weight_flops), self._ms(head.weight_flops)),
            R=forward,
            comm=1e3 * (hw.latency + stage_input_bytes(self.model, micro_batch) / self._link(pp)),
            M_B=per_stage(layer.activation_bytes, head.activation_bytes),
            M_W=per_stage(layer.weight_grad_bytes, head.weight_grad_bytes),
            M_ckpt=[stage_input_bytes(self.model, micro_batch)] * len(counts),
            M_static=[static_bytes(n, dp, zero).device for n in params],
            offload_bytes=[4 * n for n in params],
            reload_bytes=[2 * n for n in params],
            host_step_flops=[ADAM_FLOPS_PER_PARAM * n for n in params],
            M_offload=[offload_saving(n, dp, zero) for n in params],
            M_host=[static_bytes(n, offloaded=True).host for n in params],
            host_bandwidth=hw.host_bandwidth / 1e3,
            host_flops=hw.host_flops / 1e3,
            a2a_F=a2a,
            a2a_B=a2a,
            time_unit="ms",
            memory_unit="bytes",
        )

    def all_to_all_time(self, micro_batch: int) -> float:
        """Milliseconds of one layer's expert all-to-alls in a forward (the backward's are the
        same): two transfers over NVLink when the EP group fits in a node, else the network."""
        sent = all_to_all_bytes(self.model, micro_batch)
        if not sent:
            return 0.0
        hw = self.hardware
        link = hw.nvlink_bandwidth if self.model.expert_parallel <= hw.gpus_per_node else hw.network_bandwidth
        return 1e3 * 2 * (hw.latency + sent / link)

    def _link(self, ranks: int) -> float:
        """Bandwidth between neighbours of a group of `ranks` GPUs (times tp): NVLink within a node."""
        hw = self.hardware
        return hw.nvlink_bandwidth if ranks * self.tp <= hw.gpus_per_node else hw.network_bandwidth

    def allreduce_time(self, params: float, pp: int, dp: int, zero: int = 0) -> float:
        """Ring collectives across the dp replicas of a stage: the fp32 gradients' all-reduce
        (reduce-scatter under ZeRO-2) and, under ZeRO-1/2, the new weights' all-gather."""
        if dp == 1:
            return 0.0
        link = self._link(pp * dp)
        messages = 2 * (dp - 1) * (2 if zero else 1)
        return 1e3 * (collective_bytes(params, dp, zero) / link + messages * self.hardware.latency)

    def gather_time(self, params: float, pp: int, dp: int) -> float:
        """The part of ZeRO-1/2's `allreduce_time` that all-gathers the new weights (the runtime
        runs it after the optimizer step, in its optimizer phase)."""
        if dp == 1:
            return 0.0
        gathered = (dp - 1) / dp * 2 * params  # 16-bit weights, as `collective_bytes` counts them
        return 1e3 * (gathered / self._link(pp * dp) + 2 * (dp - 1) * self.hardware.latency)

    def optimizer_time(self, params: float, dp: int, zero: int = 0) -> float:
        """AdamW is memory-bound: read and write the fp32 master weights, moments and gradients
        it steps — all of them under ZeRO-0, this rank's 1/dp shard under ZeRO-1/2."""
        stepped = params / dp if zero else params
        return 1e3 * stepped * 2 * 16 / self.hardware.hbm_bandwidth

    def step_overhead_time(self) -> float:
        """Not modelled: on a GPU, loading a batch and launching kernels hide under the compute."""
        return 0.0

    @property
    def sync_overlaps_compute(self) -> bool:
        """A GPU's collectives run on their own streams and links beside the kernels (NCCL)."""
        return True

    def replica_skew(self, dp: int, zero: int = 0) -> float:
        """Not modelled: GPU replicas run their pipelines in near lockstep."""
        return 0.0

    def to_dict(self) -> dict:
        return {"source": "analytic", "hardware": self.hardware.to_dict(), "tp": self.tp}
