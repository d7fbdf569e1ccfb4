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
from dataclasses import dataclass, replace
from typing import Protocol

from pipeloom.costs import Costs
from pipeloom.profile_format import Profile, Speed
from pipeloom.static_memory import collective_bytes, offload_saving, static_bytes
from pipeloom.tune.analytic import (
    all_to_all_bytes,
    head_figures,
    kv_exchange_bytes,
    layer_figures,
    stage_input_bytes,
)
from pipeloom.tune.presets import HardwareSpec, ModelSpec
from pipeloom.tune.topology import Link, Split
from pipeloom.tune.tp_layout import layer_collectives, replicated_params, ring_bytes

__all__ = ["CostModel", "AnalyticCostModel", "ADAM_FLOPS_PER_PARAM"]

ADAM_FLOPS_PER_PARAM = 16
"""Arithmetic of one AdamW update per weight (moments, bias correction, decay, step)."""


class CostModel(Protocol):
    model: ModelSpec
    source: str
    """Where the numbers come from: a hardware preset's name, or "profile"."""

    @property
    def split(self) -> Split:
        """How each stage's ranks are cut (tp, cp, ep) in the plans this model prices."""
        ...

    def with_split(self, split: Split) -> CostModel:
        """The same costs for plans whose stages' ranks are cut as `split` says."""
        ...

    def stage_costs(
        self, counts: Sequence[int], micro_batch: int, pp: int, dp: int, zero: int = 0, slices: int = 1
    ) -> Costs: ...

    def layer_time(self, micro_batch: int) -> float: ...

    def end_times(self, micro_batch: int) -> tuple[float, float]: ...

    def stage_params(self, counts: Sequence[int]) -> list[float]: ...

    def expert_params(self, counts: Sequence[int]) -> list[float]:
        """Of `stage_params`, the routed experts' (a rank's num_experts / EP of them): their
        gradients are summed over only the replicas that hold the same experts."""
        ...

    def tied_params(self) -> float:
        """Of `stage_params`, what the first and the last stage both count (a tied embedding, a
        rank's shard of it): one object, stepped and synced once, on a device hosting both."""
        ...

    def allreduce_time(self, params: float, pp: int, dp: int, zero: int = 0) -> float: ...

    def tp_sum_time(self, layers: int, micro_batch: int) -> float:
        """Under sequence parallelism, the sum over a device's tp ranks, after the pipeline and
        the replicas' sync, of the gradients of the weights each holds whole (every tp rank saw
        only its shard of the sequence), for a device of `layers` layers; 0 without it."""
        ...

    def optimizer_time(self, params: float, dp: int, zero: int = 0) -> float: ...

    def gather_time(self, params: float, pp: int, dp: int) -> float: ...

    def step_overhead_time(self, zeroed: float = 0.0) -> float: ...

    def replica_skew(self, dp: int, zero: int = 0) -> float: ...

    @property
    def sync_contention(self) -> float:
        """The share of a stage's gradient sync, started as its last backward ends under the
        device's later ops (`measures.StaticOption.stage_sync`), that those ops lose to it: 0
        where it runs beside them, 1 where it takes all its time from them."""
        ...

    @property
    def profile(self) -> Profile | None:
        """The measurements the costs were read from; None for a hardware preset's."""
        ...

    def layout_speed(self) -> Speed | None:
        """How a rank's step and an op vary from step to step on the plan's ranks, as measured
        (`tune.speed_noise` prices it); None where nothing was measured."""
        ...

    def extrapolations(self, micro_batch: int, slices: int = 1, partition: Sequence[int] = ()) -> list[str]:
        """Why a plan at `micro_batch`, in `slices` slices, of `partition` (layers per stage) is
        priced beyond what was measured; [] where it is not, or where nothing was measured."""
        ...

    def to_dict(self) -> dict: ...

    def __hash__(self) -> int: ...  # the tuner caches stage costs per model (`measures`)


@dataclass(frozen=True)
class AnalyticCostModel:
    """Costs from FLOPs and bytes (`analytic`) on a hardware preset's peaks, every collective on
    the link its group spans on the cluster's nodes (`topology.Split.links`)."""

    model: ModelSpec
    hardware: HardwareSpec
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False

    @property
    def source(self) -> str:
        return self.hardware.name

    @property
    def split(self) -> Split:
        return Split(self.tp, self.cp, self.model.expert_parallel)

    def with_split(self, split: Split) -> AnalyticCostModel:
        """The same model and hardware with each stage's ranks cut as `split` says."""
        model = self.model if split.ep == self.model.expert_parallel else replace(self.model, expert_parallel=split.ep)
        return replace(self, model=model, tp=split.tp, cp=split.cp)

    def links(self, dp: int = 1, pp: int = 1) -> dict[str, Link]:
        """Each dimension's link for a plan of `dp` replicas and `pp` pipeline devices."""
        hw = self.hardware
        return self.split.links(dp, pp, hw.gpus_per_node, hw.nvlink_bandwidth, hw.network_bandwidth)

    def _ms(self, flops: float) -> float:
        return 1e3 * flops / (self.hardware.peak_flops * self.hardware.efficiency)

    def _layer(self, micro_batch: int):
        return layer_figures(self.model, micro_batch, self.tp, self.cp, self.sequence_parallel)

    def _ring_ms(self, names: Sequence[str], nbytes: float, ranks: int, link: Link) -> float:
        """Ring collectives `names` over `ranks` on `link`, each on `nbytes` of the whole group's."""
        steps = sum(2 * (ranks - 1) if name == "allreduce" else ranks - 1 for name in names)
        return 1e3 * (ring_bytes(names, nbytes, ranks) / link.bandwidth + steps * self.hardware.latency)

    def exchange_times(self, micro_batch: int) -> dict[str, tuple[float, float]]:
        """A layer's collectives in its forward and its backward (ms): "tp" (Megatron's entries to
        and exits from the tensor-parallel region), "cp" (the K/V all-gather, and its gradients'
        reduce-scatter); each present only where that dimension splits."""
        links = self.links()
        out: dict[str, tuple[float, float]] = {}
        if self.tp > 1:
            activation = 2 * micro_batch * self.model.seq_len / self.cp * self.model.hidden
            collectives = layer_collectives(self.tp, self.sequence_parallel)
            forward, backward = (self._ring_ms(collectives[k], activation, self.tp, links["tp"]) for k in ("F", "B"))
            out["tp"] = (forward, backward)
        if self.cp > 1:
            sent = kv_exchange_bytes(self.model, micro_batch, self.tp, self.cp)
            once = 1e3 * (sent / links["cp"].bandwidth + (self.cp - 1) * self.hardware.latency)
            out["cp"] = (once, once)
        return out

    def _layer_times(self, micro_batch: int) -> tuple[float, float, float]:
        """(F, B, W) of one layer, its exchanges included."""
        layer = self._layer(micro_batch)
        exchanges = self.exchange_times(micro_batch).values()
        return (
            self._ms(layer.forward_flops) + sum(f for f, _ in exchanges),
            self._ms(layer.backward_flops) + sum(b for _, b in exchanges),
            self._ms(layer.weight_flops),
        )

    def layer_time(self, micro_batch: int) -> float:
        return sum(self._layer_times(micro_batch))

    def end_times(self, micro_batch: int) -> tuple[float, float]:
        """Extra time of the first stage (embedding: a lookup) and the last (head and loss)."""
        head = head_figures(self.model, micro_batch, self.tp, self.cp)
        return 0.0, self._ms(head.forward_flops + head.backward_flops + head.weight_flops)

    def expert_params(self, counts: Sequence[int]) -> list[float]:
        return [n * self.model.stored_expert_params / self.tp for n in counts]

    def tied_params(self) -> float:
        return 0.0  # a preset's head is its own weight (`ModelSpec.params`)

    def stage_params(self, counts: Sequence[int]) -> list[float]:
        layer = self.model.stored_layer_params / self.tp
        embedding = self.model.vocab * self.model.hidden / self.tp
        last = len(counts) - 1
        return [n * layer + embedding * ((i == 0) + (i == last)) for i, n in enumerate(counts)]

    def stage_costs(
        self, counts: Sequence[int], micro_batch: int, pp: int, dp: int, zero: int = 0, slices: int = 1
    ) -> Costs:
        """Per-stage costs of whole micro-batches; a schedule with `slices` shares them out
        (FLOPs and bytes scale with the tokens), so `slices` changes nothing here. The weights'
        copies that share their gradients and optimizer shards are the dp × cp ranks."""
        layer = self._layer(micro_batch)
        head = head_figures(self.model, micro_batch, self.tp, self.cp)
        forward_layer, backward_layer, weight_layer = self._layer_times(micro_batch)
        last = len(counts) - 1

        def per_stage(per_layer: float, on_last: float) -> list[float]:
            return [n * per_layer + (on_last if i == last else 0.0) for i, n in enumerate(counts)]

        params = self.stage_params(counts)
        hw = self.hardware
        copies = dp * self.cp
        forward = per_stage(forward_layer, self._ms(head.forward_flops))
        a2a_per_layer = self.all_to_all_time(micro_batch)
        a2a = per_stage(a2a_per_layer, 0.0) if a2a_per_layer else 0.0  # dense: the key stays unset
        # each tp rank sends its sequence shard under sequence parallelism, the whole otherwise
        boundary = stage_input_bytes(self.model, micro_batch, self.cp) / (self.tp if self.sequence_parallel else 1)
        return Costs(
            F=forward,
            B=per_stage(backward_layer, self._ms(head.backward_flops)),
            W=per_stage(weight_layer, self._ms(head.weight_flops)),
            R=forward,
            comm=1e3 * (hw.latency + boundary / self.links(dp, pp)["pp"].bandwidth),
            M_B=per_stage(layer.activation_bytes, head.activation_bytes),
            M_W=per_stage(layer.weight_grad_bytes, head.weight_grad_bytes),
            M_ckpt=[stage_input_bytes(self.model, micro_batch, self.cp)] * len(counts),
            M_static=[static_bytes(n, copies, zero).device for n in params],
            offload_bytes=[4 * n for n in params],
            reload_bytes=[2 * n for n in params],
            host_step_flops=[ADAM_FLOPS_PER_PARAM * n for n in params],
            M_offload=[offload_saving(n, copies, zero) for n in params],
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
        same): two transfers on the link the EP group spans."""
        sent = all_to_all_bytes(self.model, micro_batch, self.cp)
        if not sent:
            return 0.0
        return 1e3 * 2 * (self.hardware.latency + sent / self.links()["ep"].bandwidth)

    def allreduce_time(self, params: float, pp: int, dp: int, zero: int = 0) -> float:
        """Ring collectives across the dp × cp copies of a stage, on the link their group spans:
        the fp32 gradients' all-reduce (reduce-scatter under ZeRO-2) and, under ZeRO-1/2, the new
        weights' all-gather."""
        copies = dp * self.cp
        if copies == 1:
            return 0.0
        messages = 2 * (copies - 1) * (2 if zero else 1)
        link = self.links(dp, pp)["dp"]
        return 1e3 * (collective_bytes(params, copies, zero) / link.bandwidth + messages * self.hardware.latency)

    def tp_sum_time(self, layers: int, micro_batch: int) -> float:
        """A ring all-reduce over the tp ranks of the fp32 gradients of each layer's two norms and
        the final one, on the link the tp group spans."""
        if not self.sequence_parallel or self.tp == 1:
            return 0.0
        replicated = replicated_params(self.model.hidden, layers)
        return self._ring_ms(["allreduce"], 4 * replicated, self.tp, self.links()["tp"])

    def gather_time(self, params: float, pp: int, dp: int) -> float:
        """The part of ZeRO-1/2's `allreduce_time` that all-gathers the new weights (the runtime
        runs it after the optimizer step, in its optimizer phase)."""
        copies = dp * self.cp
        if copies == 1:
            return 0.0
        gathered = (copies - 1) / copies * 2 * params  # 16-bit weights, as `collective_bytes` counts them
        link = self.links(dp, pp)["dp"]
        return 1e3 * (gathered / link.bandwidth + 2 * (copies - 1) * self.hardware.latency)

    def optimizer_time(self, params: float, dp: int, zero: int = 0) -> float:
        """AdamW is memory-bound: read and write the fp32 master weights, moments and gradients
        it steps — all of them under ZeRO-0, this rank's 1/(dp × cp) shard under ZeRO-1/2."""
        stepped = params / (dp * self.cp) if zero else params
        return 1e3 * stepped * 2 * 16 / self.hardware.hbm_bandwidth

    def step_overhead_time(self, zeroed: float = 0.0) -> float:
        """Not modelled: on a GPU, loading a batch, launching kernels and zeroing the gradient
        buffers hide under the compute."""
        return 0.0

    @property
    def sync_contention(self) -> float:
        """A GPU's collectives run on their own streams and links beside the kernels (NCCL)."""
        return 0.0

    def replica_skew(self, dp: int, zero: int = 0) -> float:
        """Not modelled: GPU replicas run their pipelines in near lockstep."""
        return 0.0

    @property
    def profile(self) -> None:
        """A preset's peaks, not measurements: no plan lies beyond them, none is noisier."""
        return None

    def layout_speed(self) -> None:
        return None

    def extrapolations(self, micro_batch: int, slices: int = 1, partition: Sequence[int] = ()) -> list[str]:
        return []

    def to_dict(self) -> dict:
        out = {"source": "analytic", "hardware": self.hardware.to_dict(), "tp": self.tp, "cp": self.cp}
        return out | ({"sequence_parallel": True} if self.sequence_parallel else {})
