"""Costs measured on this machine (`pipeloom profile`), as a cost model the tuner can use.

Each op, stash and exchange is read off the fits of the layout the plan's ranks hold (a slope per
layer, an intercept per stage position; `profile_format`), interpolated linearly between the
profiled micro-batch sizes: the plain probes', or those measured in the plan's slices, on its tp
ranks, or on replicas sharing out its experts. Where the profile lacks the plan's layout the
plain fits are adapted — a slice priced as a smaller micro-batch; under tp the compute split over
the ranks and Megatron's collectives added from the measured links (`tp_layout`) — and `tune`
marks the plan as beyond the profile (`extrapolations`). What the runtime adds beyond the ops is
priced as measured: a per-op overhead, p2p as latency + bytes / bandwidth, the dp = 2 collectives
scaled to other dp by the ring, the optimizer step, the rest of a step, and the replicas' wait.
Static memory is `static_memory`'s. The file also carries plain Costs keys (two devices) so
`simulate --costs profile.json` reads it too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from os import PathLike
from typing import Any

from pipeloom.costs import Costs, CostValue
from pipeloom.errors import ConfigError
from pipeloom.files import read_json
from pipeloom.profile_format import Fit, Layout, LayoutProfile, Profile, Speed
from pipeloom.static_memory import compute_bytes, static_bytes
from pipeloom.tune.presets import ModelSpec
from pipeloom.tune.profile_fits import at_size
from pipeloom.tune.topology import Split
from pipeloom.tune.tp_layout import (
    activation_share,
    layer_collectives,
    replicated_params,
    ring_bytes,
    stage_collectives,
)

__all__ = ["ProfiledCostModel", "profile_costs_keys"]

_TIMES = ("F", "B", "W", "R")
_PASS = {"F": "F", "R": "F", "F_BW": "F", "B": "B", "BW": "B"}
"""Which pass of a layer's each op kind runs: a forward's exchanges, or a backward's (W has none)."""
Fits = Mapping[int, Mapping[str, Fit]]
"""Micro-batch size → kind → Fit: one layout's fits."""


class ProfiledCostModel:
    def __init__(self, profile: Profile | Mapping[str, Any], tp: int = 1, sequence_parallel: bool = False, cp: int = 1):
        for name, value in (("tp", tp), ("cp", cp)):
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name} must be at least 1, got {value!r}")
        self.tp, self.cp, self.sequence_parallel = tp, cp, sequence_parallel and tp > 1
        self._asked_sequence_parallel = sequence_parallel
        """As asked, kept for the splits of tp > 1 (`with_split`) from the unsplit model."""
        self.profile = profile if isinstance(profile, Profile) else Profile.from_dict(profile)
        self.model: ModelSpec = self.profile.model
        plain = self.profile.plain
        self.sizes = plain.sizes
        self.fits = plain.fits
        self.params = self.profile.params
        self.links = self.profile.links
        self.overheads = self.profile.overheads
        self.compute = compute_bytes(self.profile.dtype)
        expert = self.profile.expert_parallel
        self.expert_ep: int = expert[0] if expert else 1
        self.expert_layout: LayoutProfile | None = expert[1] if expert else None
        """The expert-parallel probes' group and their measurements (`Layout(ep=...)`), if any."""
        self.source = "profile"
        measured = self.profile.layout(Layout(tp, self.sequence_parallel)) if tp > 1 else None
        self._tp_layout = measured if measured is not None and measured.fits else None
        """This layout's fits as measured on tp ranks (`profile --tp`); None if not measured."""
        context = self.profile.layout(Layout(cp=cp)) if cp > 1 and tp == 1 else None
        self._cp_layout = context if context is not None and context.fits else None
        """The fits measured on one stage over cp ranks (`profile --cp`); None if not measured:
        then a rank's ops are the plain ones at 1/cp of the micro-batch, plus the K/V exchange."""

    @property
    def split(self) -> Split:
        return Split(self.tp, self.cp, self.model.expert_parallel)

    def with_split(self, split: Split) -> ProfiledCostModel:
        """The same profile pricing each stage's ranks cut as `split` says."""
        other = ProfiledCostModel(self.profile, split.tp, self._asked_sequence_parallel, split.cp)
        other.model = (
            self.model if split.ep == self.model.expert_parallel else replace(self.model, expert_parallel=split.ep)
        )
        return other

    def measured_splits(self, sequence_parallel: bool = False) -> list[Split]:
        """The splits the profile ran probes on (its tp layouts, with sequence parallelism as
        asked; its cp layouts; the expert group of a MoE model), one dimension at a time: what
        `tune --costs` weighs by default."""
        layouts = [layout for layout, measured in self.profile.layouts.items() if measured.fits]
        tps = {layout.tp for layout in layouts if layout.tp > 1 and layout.sequence_parallel == sequence_parallel}
        cps = {layout.cp for layout in layouts if layout.cp > 1}
        eps = {self.expert_ep} if self.expert_layout is not None and self.expert_ep > 1 else set()
        return [Split(), *(Split(tp=n) for n in sorted(tps)), *(Split(cp=n) for n in sorted(cps))] + [
            Split(ep=n) for n in sorted(eps)
        ]

    @classmethod
    def load(cls, path: str | PathLike[str], tp: int = 1, sequence_parallel: bool = False) -> ProfiledCostModel:
        return cls(Profile.from_dict(read_json(path, "profile", ConfigError)), tp, sequence_parallel)

    # -- tensor parallelism ------------------------------------------------------------------------

    def _activation_bytes(self, micro_batch: float) -> float:
        """The hidden states of `micro_batch` sequences (under cp, a rank's share: micro_batch / cp)."""
        return self.compute * micro_batch * self.model.seq_len * self.model.hidden

    def _kv_bytes(self, share: float) -> float:
        """A layer's keys and values on one rank holding `share` (micro-batch / cp) of the
        sequences' tokens."""
        return 2 * self.compute * share * self.model.seq_len * self.model.kv_hidden / self.tp

    def _kv_exchange(self, share: float) -> float:
        """A layer's K/V all-gather over the cp ranks (the backward's reduce-scatter of their
        gradients costs as much), priced by the measured collectives."""
        return self._collective("all_gather", self._kv_bytes(share) * self.cp, self.cp)

    def tp_collectives(self, stage: int, stages: int, layers: int) -> dict[str, list[str]]:
        """The tensor-parallel collectives of a stage's F and B (`tp_layout.stage_collectives`)."""
        return stage_collectives(self.tp, self.sequence_parallel, stage, stages, layers)

    @property
    def _sharing_experts(self) -> bool:
        return self.model.expert_parallel > 1 and bool(self.model.num_experts)

    def ranks_layout(self) -> LayoutProfile | None:
        """The measurements of the plan's ranks where the profile has them: on its tp ranks, its
        cp ranks, or (experts shared out, tp = 1) on replicas sharing out the experts; None where
        the plain probes price its ops."""
        if self.cp > 1:
            return self._cp_layout
        if self.tp > 1:
            return self._tp_layout
        expert = self.expert_layout
        return expert if self._sharing_experts and expert is not None and expert.fits else None

    def layout_speed(self) -> Speed:
        """How a rank's step and an op vary from step to step on the plan's ranks: collective waits
        inside their ops vary and skew them, so measured on those ranks where the profile did."""
        ranks = self.ranks_layout()
        return ranks.speed if ranks and ranks.speed.step else self.profile.plain.speed

    def _ranks_per_stage(self, layout: LayoutProfile, key: str, counts: Sequence[int], size: float) -> list[float]:
        """A stage's op as measured on the plan's ranks (one stage): the measured slope per layer,
        and the single stage's measured intercept — at another position, the plain intercept
        there scaled as the single stage's was (the embedding's and the head's share of it)."""
        slope = self._value(key, "per_layer", size, layout.fits)
        single = self._value(key, "single", size, layout.fits)
        alone = self._value(key, "single", size) if key in self.profile.plain.kinds() else 0.0
        out = []
        for i, n in enumerate(counts):
            position = self._position(i, len(counts))
            intercept = (
                single if position == "single" or alone <= 0 else self._value(key, position, size) * single / alone
            )
            out.append(n * slope + intercept)
        return out

    def _tp_time(self, names: list[str], micro_batch: float) -> float:
        nbytes = self._activation_bytes(micro_batch)
        return sum(self._collective(name, nbytes, self.tp) for name in names)

    def tp_sum_time(self, layers: int, micro_batch: int) -> float:
        """Sequence parallelism's sum, after the pipeline, of the gradients of the weights each tp
        rank holds whole (the norms), for a device of `layers` layers: the sync phase of the
        probes run under it; where the profile did not run them (the plan is then marked as
        beyond it), an all-reduce of each layer's two norms and the final one on the measured
        link. 0 without sequence parallelism."""
        if not self.sequence_parallel:
            return 0.0
        measured = self._tp_layout
        if measured is None or "sync" not in measured.kinds():
            return self._collective("allreduce", 4 * replicated_params(self.model.hidden, layers), self.tp)
        return self._per_stage("sync", [layers], micro_batch, measured.fits)[0]

    def tp_step(self, schedule, partition: Sequence[int], micro_batch: int) -> tuple[list[float], list[float]]:
        """Per device, the (ms, bytes sent: `tp_layout.ring_bytes`) of one step's tensor-parallel
        collectives."""
        size = micro_batch / schedule.num_slices / self.cp
        names = [
            [
                name
                for op in ops
                if op.kind.value in _PASS
                for name in self.tp_collectives(op.stage, len(partition), partition[op.stage])[_PASS[op.kind.value]]
            ]
            for ops in schedule.devices
        ]
        nbytes = self._activation_bytes(size)
        return [self._tp_time(n, size) for n in names], [ring_bytes(n, nbytes, self.tp) for n in names]

    def kv_step(self, schedule, partition: Sequence[int], micro_batch: int) -> list[float]:
        """Per device, the bytes one rank sends a step in its context-parallel group's K/V
        exchanges, as a ring moves them: each layer's keys and values all-gathered in every F and
        R, their gradients reduce-scattered in every B — (cp − 1) times its own each."""
        own = self._kv_bytes(micro_batch / schedule.num_slices / self.cp)
        return [
            sum(partition[op.stage] for op in ops if op.kind.value in _PASS) * (self.cp - 1) * own
            for ops in schedule.devices
        ]

    def extrapolations(self, micro_batch: int, slices: int = 1, partition: Sequence[int] = ()) -> list[str]:
        """Why a plan at `micro_batch` (in `slices` slices, `partition`: layers per stage) is
        priced beyond what the profile measured — a size outside its micro-batch sizes (a slice
        is priced as a micro-batch 1/slices the size), slices it never ran, a tensor- or
        expert-parallel group it never ran, a stage holding more or fewer layers than its probes
        did — or []."""
        sliced = self._sliced(slices)
        sizes = sliced.sizes if sliced else self.sizes
        size = micro_batch / slices
        reasons = []
        if slices > 1 and not sliced:
            reasons.append(f"{slices} slices (never profiled: priced as micro-batches of {size:g})")
        elif not sizes[0] <= micro_batch <= sizes[-1]:
            where = f" in {slices} slices" if sliced else ""
            reasons.append(f"micro-batch size {micro_batch} (profiled{where}: {', '.join(map(str, sizes))})")
        if self.tp > 1 and not self._tp_layout:
            reasons.append(f"tp {self.tp} (never profiled: its collectives estimated)")
        if self.cp > 1 and self._cp_layout is None:
            reasons.append(f"cp {self.cp} (never profiled: 1/{self.cp} of the tokens and the K/V exchange estimated)")
        ep = self.model.expert_parallel
        if self._sharing_experts and (ep != self.expert_ep or self.tp > 1):
            profiled = (
                f"profiled: ep {self.expert_ep}" if self.expert_layout else "never profiled: no all-to-all priced"
            )
            reasons.append(f"ep {ep} ({profiled}{', not with tp' if self.expert_layout and self.tp > 1 else ''})")
        probed = sorted(set(self.measured_layout(slices).layers))
        beyond = sorted({n for n in partition if probed and not probed[0] <= n <= probed[-1]})
        if beyond:
            counts = ", ".join(map(str, beyond))
            reasons.append(f"{counts} layers a stage (profiled: {', '.join(map(str, probed))})")
        return reasons

    def measured_layout(self, slices: int = 1) -> LayoutProfile:
        """The measurements that price a plan's ops: the probes run in its slices, or on its
        ranks (`ranks_layout`), where the profile has them; else the plain ones."""
        return self._sliced(slices) or self.ranks_layout() or self.profile.plain

    def _sliced(self, slices: int) -> LayoutProfile | None:
        """The probes run in `slices` slices (`profile --slices`), which price a sliced plan's
        ops as measured; None where the profile has none, or under tp (which slices do not run
        with)."""
        return self.profile.sliced(slices) if self.tp == 1 else None

    def _value(self, key: str, field: str, micro_batch: float, fits: Fits | None = None) -> float:
        """A fitted coefficient at `micro_batch`, linear between the profiled sizes: of the plain
        probes, or of `fits`."""
        by_size = self.fits if fits is None else fits
        return at_size({size: fit[key].at(field) for size, fit in by_size.items()}, micro_batch)

    def p2p_ms(self, micro_batch: float) -> float:
        """An activation of the micro-batch, in the compute type, over the measured link."""
        return self.links.p2p.ms(self._activation_bytes(micro_batch))

    @staticmethod
    def _position(stage: int, stages: int) -> str:
        if stages == 1:
            return "single"
        return "first" if stage == 0 else "last" if stage == stages - 1 else "middle"

    def _per_stage(self, key: str, counts: Sequence[int], micro_batch: float, fits: Fits | None = None) -> list[float]:
        slope = self._value(key, "per_layer", micro_batch, fits)
        return [
            n * slope + self._value(key, self._position(i, len(counts)), micro_batch, fits)
            for i, n in enumerate(counts)
        ]

    def _static(self, params: float, dp: int, zero: int) -> float:
        if zero == 0:
            return params * self.profile.static_bytes_per_param
        return static_bytes(params, dp, zero, compute=self.compute).device

    def stage_costs(
        self, counts: Sequence[int], micro_batch: int, pp: int, dp: int, zero: int = 0, slices: int = 1
    ) -> Costs:
        """With `slices`, each slice's op is as the probes run in that many slices measured it
        (`profile --slices`); without them, priced as an op on a micro-batch of 1/slices the size
        — the fits extended below the smallest profiled size — so a slice keeps its fixed costs
        (the fits' intercepts) instead of a 1/slices share of them."""
        share = micro_batch / slices / self.cp  # a rank's tokens: as many FLOPs as 1/cp of the sequences
        size = share if self._cp_layout is None else micro_batch / slices  # cp ranks' fits: by micro-batch
        sliced = self._sliced(slices)
        fits, at = (sliced.fits, float(micro_batch) / self.cp) if sliced else (self.fits, size)
        fused = all({"BW", "F_BW"} <= by_kind.keys() for by_kind in fits.values())  # measured (else B + W)
        times = (*_TIMES, "BW", "F_BW") if fused else _TIMES
        per_stage = {key: self._per_stage(key, counts, at, fits) for key in (*times, "M_B", "M_W")}
        per_stage["M_ckpt"] = [
            min(self._value("M_ckpt", self._position(i, len(counts)), at, fits), m)
            for i, m in enumerate(per_stage["M_B"])
        ]
        if self.tp > 1:
            share = activation_share(self.tp, self.sequence_parallel)
            per_stage["M_B"] = [m * share for m in per_stage["M_B"]]
            per_stage["M_W"] = [m * share for m in per_stage["M_W"]]
            per_stage["M_ckpt"] = [m / self.tp for m in per_stage["M_ckpt"]]
        if ranks := self.ranks_layout():
            for key in ranks.kinds() & per_stage.keys():
                per_stage[key] = self._ranks_per_stage(ranks, key, counts, size)
            if not {"BW", "F_BW"} <= ranks.kinds():  # the plain probes' fused backward says nothing of these
                per_stage.pop("BW", None)
                per_stage.pop("F_BW", None)
        elif self.tp > 1:
            for i, n in enumerate(counts):
                collectives = self.tp_collectives(i, len(counts), n)
                for key in per_stage.keys() & {*_PASS, "W"}:
                    extra = self._tp_time(collectives[_PASS[key]], size) if key in _PASS else 0.0
                    per_stage[key][i] = per_stage[key][i] / self.tp + extra
        if self.cp > 1 and self._cp_layout is None:  # measured on cp ranks, the exchanges are inside the ops
            kv = self._kv_exchange(share)
            for key in per_stage.keys() & _PASS.keys():
                per_stage[key] = [value + n * kv for value, n in zip(per_stage[key], counts)]
        # With slices, per-slice entries: Costs would otherwise share a stage's value out evenly.
        value: dict[str, CostValue] = {
            key: [[v] * slices for v in values] if slices > 1 else values for key, values in per_stage.items()
        }
        exchange = self._exchange(counts, size)
        return Costs(
            F=value["F"],
            B=value["B"],
            W=value["W"],
            BW=value.get("BW"),
            F_BW=value.get("F_BW"),
            R=value["R"],
            a2a_F=exchange["F"],
            a2a_B=exchange["B"],
            comm=self.p2p_ms(share / self.tp),  # each tensor-parallel rank sends its sequence shard
            M_B=value["M_B"],
            M_W=value["M_W"],
            M_ckpt=value["M_ckpt"],
            M_static=[self._static(n, dp * self.cp, zero) for n in self.stage_params(counts)],
            M_shared=self._static(self.tied_params(), dp * self.cp, zero),
            op_overhead=self.overheads.op_ms,
            time_unit="ms",
            memory_unit="bytes",
        )  # no host link measured: offload is left out, not guessed

    def _exchange(self, counts: Sequence[int], micro_batch: float) -> dict[str, CostValue]:
        """Per stage, the expert all-to-alls in flight in an F and in a B, as the expert-parallel
        probes measured them; none for a dense model, without expert parallelism, or from a
        profile that measured none."""
        expert = self.expert_layout
        if not self._sharing_experts or expert is None or not {"a2a_F", "a2a_B"} <= expert.kinds():
            return {"F": 0.0, "B": 0.0}
        return {kind: self._ranks_per_stage(expert, f"a2a_{kind}", counts, micro_batch) for kind in ("F", "B")}

    def a2a_step(self, schedule, partition: Sequence[int], micro_batch: int) -> list[float]:
        """Per device, the ms of one step's expert all-to-alls in flight (F and R: a2a_F; B and
        BW: a2a_B), as the runtime reports them beside the hidden part."""
        exchange = self._exchange(partition, micro_batch / schedule.num_slices)
        per_stage = {way: value for way, value in exchange.items() if isinstance(value, list)}
        if len(per_stage) < 2:
            return [0.0] * schedule.num_devices
        return [
            sum(per_stage[_PASS[op.kind.value]][op.stage] for op in ops if op.kind.value in _PASS)
            for ops in schedule.devices
        ]

    def layer_time(self, micro_batch: float) -> float:
        """A layer's F + B + W as `stage_costs` prices it: on the plan's ranks where measured, else
        the plain ops (at a cp rank's share of the micro-batch) split over tp, their collectives
        and K/V exchanges added."""
        if ranks := self.ranks_layout():
            measured = ranks.kinds()
            return sum(
                self._value(key, "per_layer", micro_batch, ranks.fits) for key in ("F", "B", "W") if key in measured
            )
        share = micro_batch / self.cp
        compute = sum(self._value(key, "per_layer", share) for key in ("F", "B", "W")) / self.tp
        layer = layer_collectives(self.tp, self.sequence_parallel)
        return compute + self._tp_time(layer["F"] + layer["B"], share) + 2 * self._kv_exchange(share)

    def end_times(self, micro_batch: int) -> tuple[float, float]:
        def extra(position: str) -> float:
            return sum(
                self._value(key, position, micro_batch) - self._value(key, "middle", micro_batch)
                for key in ("F", "B", "W")
            )

        return max(0.0, extra("first")), max(0.0, extra("last"))

    def stage_params(self, counts: Sequence[int]) -> list[float]:
        """Parameters one rank holds per stage: its 1/tp shard of the layers, embedding and head;
        of a MoE layer's block, which the runtime runs whole on every tp rank (`models.hf_tp`),
        the router and shared experts whole and its 1/ep share of the routed experts."""
        last = len(counts) - 1
        block = max(self.params.moe_block, self.params.experts)  # a profile without the block: its experts
        cut = self.params.layer - block
        whole = block - self.params.experts + self.params.experts / self.model.expert_parallel
        return [
            (n * cut + self.params.first * (i == 0) + self.params.last * (i == last)) / self.tp + n * whole
            for i, n in enumerate(counts)
        ]

    def tied_params(self) -> float:
        return self.params.tied / self.tp

    def expert_params(self, counts: Sequence[int]) -> list[float]:
        """Of `stage_params`, a rank's 1/ep share of the routed experts (whole on its tp ranks)."""
        held = self.params.experts / self.model.expert_parallel
        return [n * held for n in counts]

    def allreduce_time(self, params: float, pp: int, dp: int, zero: int = 0) -> float:
        """The gradients' collectives over dp replicas as measured at dp = 2 and scaled by the
        ring: ZeRO-0 all-reduces the fp32 gradients, ZeRO-1/2 reduce-scatter them and all-gather
        the new weights in the compute type."""
        if zero == 0:  # the cp ranks hold the same weights: they sum with the replicas
            return self._collective("allreduce", 4 * params, dp * self.cp)
        return self._collective("reduce_scatter", 4 * params, dp * self.cp) + self.gather_time(params, pp, dp)

    def gather_time(self, params: float, pp: int, dp: int) -> float:
        """The all-gather of ZeRO-1/2's new weights, part of `allreduce_time` (the runtime runs it
        in its optimizer phase)."""
        return self._collective("all_gather", self.compute * params, dp * self.cp)

    def _collective(self, name: str, nbytes: float, dp: int) -> float:
        """dp − 1 latencies and 2(dp − 1)/dp of the bytes, from the dp = 2 fit (which moved half):
        nothing over one rank."""
        link = self.links.collective(name)
        return (dp - 1) * link.latency_ms + nbytes * 2 * (dp - 1) / dp / link.bytes_per_ms

    def optimizer_time(self, params: float, dp: int, zero: int = 0) -> float:
        """The AdamW step as measured, over this rank's 1/dp shard under ZeRO-1/2."""
        return self.overheads.optimizer.ms(params / (dp * self.cp) if zero else params)

    def replica_skew(self, dp: int, zero: int = 0) -> float:
        """Share of the pipeline the dp replicas' collectives wait for the slowest one: measured
        at dp = 2, and grown for more replicas as the expected maximum of dp noisy pipelines
        (≈ √(2 ln dp)) grows; the pipelines' skew, so alike at every ZeRO level. Replicas that
        share out the experts exchange tokens at every MoE layer and wait for each other there,
        so theirs is measured on such replicas."""
        layout = self.expert_layout if self._sharing_experts else self.profile.plain
        wait = layout.waits.get(0) if layout and dp > 1 else None
        if wait is None:
            return 0.0
        return wait.skew_ms / wait.pipeline_ms * math.sqrt(math.log(dp) / math.log(2))

    @property
    def sync_contention(self) -> float:
        """On CPU ranks gloo sums the gradients on the cores the ops run on: the share the
        profile's links measured (all of it where they did not). A GPU's NCCL runs beside the
        kernels."""
        if self.profile.device.kind != "cpu":
            return 0.0
        measured = self.links.sync_contention
        return 1.0 if measured is None else min(1.0, measured)

    def step_overhead_time(self, zeroed: float = 0.0) -> float:
        """The rest of a step as measured: the batch, the loss all-reduce, and zeroing the
        gradient buffers that hold `zeroed` parameters for the replicas to sum in place."""
        return self.overheads.step.ms(zeroed)

    def to_dict(self) -> dict:
        facts: dict[str, Any] = {"source": "profile", "device": self.profile.device.description, "tp": self.tp}
        if self.cp > 1:
            facts["cp"] = self.cp
        if self.sequence_parallel:
            facts["sequence_parallel"] = True
        if self.profile.source:  # the profiled model itself (hf:DIR), for `train --plan`
            facts["model"] = self.profile.source
        return facts


def profile_costs_keys(model: ProfiledCostModel) -> dict:
    """Plain Costs keys for `simulate --costs`: two devices, layers split evenly, first size."""
    half = max(1, model.model.layers // 2)
    costs = model.stage_costs([half, model.model.layers - half], model.sizes[0], 2, 1)
    return {key: value for key, value in costs.to_dict().items()}
