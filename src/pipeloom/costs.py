"""Costs: how long each op takes and how much memory it holds (docs/design.md §2).

One meaning everywhere, so that schedules with different stage counts compare fairly:

* a **scalar** describes *one device's share of the model* (1/p of the layers) for one
  micro-batch. A schedule with S stages on p devices charges each stage p/S of it (1/v with
  v chunks per device) and each slice 1/L of that. Thus 1F1B's peak activation memory is
  p·M_B whatever the chunking, and interleaving shrinks ops rather than adding work;
* a **per-stage list** (length S) gives each stage's value exactly (divided by L per slice);
  an entry may itself be a list of L per-slice values.

Memory per op: F holds M_B (a checkpointed F only M_ckpt, its input); R restores M_B − M_ckpt;
with recompute_fraction r < 1 only r of the stage's layers are checkpointed, so a checkpointed F
holds M_ckpt + (1 − r)·M_B and its R takes r·R (`resolve` folds this in, so every consumer of
the resolved table — simulator, passes, schedulers — sees the same partial checkpoint);
B frees M_B and keeps M_W for its pending W; W frees M_W (each of k parts 1/k); BW frees M_B.
A device also holds M_static (weights, gradients, optimizer state) for every stage it hosts, so
replicated stages (Chimera) count twice, less M_shared where it hosts the first and the last
stage (a tied embedding both count: one object there). The fused BW takes BW where given (the
runtime's autograd backward, input and weight gradients in one pass), else B + W; the forward of
its micro-batch F_BW where given, else F.

Communication inside an op (a2a_F, a2a_B: MoE all-to-all, tensor-parallel collectives) adds to
a lone op's time and is hidden by an overlapped F&B pair as far as the other side's compute
reaches (`StageCosts.pair_time`).

T-Offload (`pipeloom.passes.offload`) reads five more per-stage keys, scaled the same way: the
gradient bytes it moves to the host, the weight bytes it loads back, the optimizer FLOPs the host
runs, M_offload, the part of M_static the device stops holding, and M_host, what the host holds
for the stage instead (so a plan can be checked against the host's memory); with the rates host_bandwidth
(bytes per time unit) and host_flops (FLOPs per time unit) they give its copy and host op times,
and p2p_host_link_share says how much p2p transfers slow the copies on a shared link.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, fields
from os import PathLike
from typing import TYPE_CHECKING, Any

from pipeloom.errors import ConfigError
from pipeloom.files import read_json
from pipeloom.stage_costs import StageCosts

if TYPE_CHECKING:
    from pipeloom.ir.schedule import Schedule

__all__ = ["Costs", "CostValue", "CostsFor", "causal_attention_fraction", "hosts_both_ends", "priced"]

CostValue = float | Sequence[float | Sequence[float]]

_PER_STAGE_KEYS = ("F", "B", "W", "BW", "F_BW", "R", "M_B", "M_W", "M_ckpt", "M_static", "a2a_F", "a2a_B")
_OFFLOAD_KEYS = ("offload_bytes", "reload_bytes", "host_step_flops", "M_offload", "M_host")
_RATE_KEYS = ("host_bandwidth", "host_flops")
_ATTENTION_KEYS = ("F", "F_BW", "B", "R")
_UNITS = {"time_unit": (None, "ms", "s", "us"), "memory_unit": (None, "bytes")}


def hosts_both_ends(stages: Collection[int], num_stages: int) -> bool:
    """Whether a device hosting `stages` holds the first and the last of `num_stages` — a single
    stage is both: a tied embedding, which both count, is one object there."""
    return {0, num_stages - 1} <= set(stages)


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Durations (any time unit) and memory (any unit: M_B = 1 counts in micro-batch activations)."""

    F: CostValue = 1.0
    """Forward time."""
    B: CostValue = 2.0
    """Input-gradient backward time (the whole backward when W is 0)."""
    W: CostValue = 0.0
    """Weight-gradient backward time."""
    BW: CostValue | None = None
    """A fused backward's time: input and weight gradients in one pass, as autograd computes them
    (a B and its W apart keep the weight GEMMs' operands for later, and are two ops); defaults to
    B + W. Split into slices evenly (its W part has no attention)."""
    F_BW: CostValue | None = None
    """The forward of a micro-batch whose backward is a BW: its linears keep nothing for a W (the
    runtime's ordinary ones); defaults to F."""
    R: CostValue | None = None
    """Recompute time of a checkpointed forward; defaults to F."""
    comm: float = 0.0
    """Latency added to every dependency between ops on different devices."""
    M_B: CostValue = 1.0
    """Activations a forward keeps for its backward."""
    M_W: CostValue = 0.0
    """What a B keeps for its pending W (inputs and output gradients of the weight GEMMs)."""
    M_ckpt: CostValue = 0.0
    """What a checkpointed forward keeps (its input)."""
    M_static: CostValue = 0.0
    """Weights, gradients and optimizer state of one device's share of the model."""
    M_shared: float = 0.0
    """Of M_static, what the first and the last stage both count (a tied embedding's weights,
    gradients and optimizer state), in M_static's unit and not scaled by stages: a device that
    hosts both ends holds one copy (`shared_static`)."""
    offload_bytes: CostValue = 0.0
    """T-Offload: gradient bytes moved to the host after a stage's last backward."""
    reload_bytes: CostValue = 0.0
    """T-Offload: weight bytes (16-bit) loaded back before a stage's first forward."""
    host_step_flops: CostValue = 0.0
    """T-Offload: optimizer FLOPs the host runs for a stage."""
    M_offload: CostValue = 0.0
    """T-Offload: the part of M_static (optimizer state, gradients) the device stops holding."""
    M_host: CostValue = 0.0
    """T-Offload: host memory an offloaded stage takes (fp32 master weights, gradients, AdamW
    moments): hosts have a limit too, per GPU a share of the node's memory."""
    host_bandwidth: float | None = None
    """Bytes per time unit between a device and its host, each way."""
    host_flops: float | None = None
    """Host FLOPs per time unit available to one device's optimizer work."""
    recompute_fraction: float = 1.0
    """Share of a checkpointed stage's layers that are checkpointed (Megatron's
    --recompute-num-layers over the stage's layers; TPipe's "1F1B + 50 % recompute"): its forward
    keeps M_ckpt plus the other layers' (1 − r)·M_B, its R takes r·R and restores the rest."""
    p2p_host_link_share: float = 1.0
    """Share of a device's host link that a p2p transfer (`comm`) takes while it runs: 1 when p2p
    crosses the same PCIe link as host copies (they pause), 0 when it has its own (NVLink)."""
    a2a_F: CostValue = 0.0
    """Communication inside a forward on its own stream (MoE expert all-to-all, tensor-parallel
    collectives) that the forward waits for: a lone F takes F + a2a_F (an R too)."""
    a2a_B: CostValue = 0.0
    """The same inside a backward: a lone B takes B + a2a_B, a BW B + W + a2a_B. An overlapped
    F&B pair hides each side's communication under the other side's compute (`pair_time`)."""
    time_unit: str | None = None
    """What the durations are in ("ms", "s", "us"); None: bare numbers ("units"). Profiles and the
    tuner's cost models give milliseconds. Only printing and plotting read it."""
    memory_unit: str | None = None
    """What the memory keys are in: "bytes" (profiles, the tuner) or None (bare numbers: with
    M_B = 1 they count micro-batches' activations of one device's share)."""
    op_overhead: float = 0.0
    """Time the runtime adds to every op whatever its size (picking it, posting and matching its
    messages, recording it): added to each F, B, W (where there is one) and R after a stage's
    time is cut into slices, so slicing a micro-batch finer costs it more ops' worth."""
    attention_fraction: float = 0.0
    """Share of F, B and R time spent in causal attention. Cutting a micro-batch into L slices
    then gives slice l the share (1−a)/L + a(2l+1)/L² instead of 1/L: its queries attend to the
    keys of every earlier slice, so later slices cost more (MEPipe §5). W has no attention."""

    def __post_init__(self) -> None:
        for key in _PER_STAGE_KEYS + _OFFLOAD_KEYS:
            value = getattr(self, key)
            if value is None and key in ("R", "BW", "F_BW"):
                continue
            object.__setattr__(self, key, _normalise(key, value))
        if not _is_number(self.comm) or self.comm < 0 or not math.isfinite(self.comm):
            raise ConfigError(f"costs: comm must be a non-negative number, got {self.comm!r}")
        object.__setattr__(self, "comm", float(self.comm))
        if not _is_number(self.M_shared) or self.M_shared < 0 or not math.isfinite(self.M_shared):
            raise ConfigError(f"costs: M_shared must be a non-negative number, got {self.M_shared!r}")
        object.__setattr__(self, "M_shared", float(self.M_shared))
        overhead = self.op_overhead
        if not _is_number(overhead) or overhead < 0 or not math.isfinite(overhead):
            raise ConfigError(f"costs: op_overhead must be a non-negative number, got {overhead!r}")
        object.__setattr__(self, "op_overhead", float(overhead))
        fraction = self.attention_fraction
        if not _is_number(fraction) or not 0 <= fraction <= 1:
            raise ConfigError(f"costs: attention_fraction must be a number from 0 to 1, got {fraction!r}")
        object.__setattr__(self, "attention_fraction", float(fraction))
        for key, allowed in _UNITS.items():
            if getattr(self, key) not in allowed:
                choices = ", ".join(str(u) for u in allowed if u)
                raise ConfigError(f"costs: {key} must be one of {choices}, got {getattr(self, key)!r}")
        fraction = self.recompute_fraction
        if not _is_number(fraction) or not 0 < fraction <= 1:
            raise ConfigError(f"costs: recompute_fraction must be a number above 0 and at most 1, got {fraction!r}")
        object.__setattr__(self, "recompute_fraction", float(fraction))
        share = self.p2p_host_link_share
        if not _is_number(share) or not 0 <= share <= 1:
            raise ConfigError(f"costs: p2p_host_link_share must be a number from 0 to 1, got {share!r}")
        object.__setattr__(self, "p2p_host_link_share", float(share))
        for key in _RATE_KEYS:
            value = getattr(self, key)
            if value is None:
                continue
            if not _is_number(value) or value <= 0 or not math.isfinite(value):
                raise ConfigError(f"costs: {key} must be a positive number, got {value!r}")
            object.__setattr__(self, key, float(value))

    # -- construction from user input ------------------------------------------------------

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Costs:
        """Build from a dict with the Costs keys, rejecting unknown keys by name."""
        if not isinstance(data, Mapping):
            raise ConfigError("costs must be a JSON object with keys " + ", ".join(cls.keys()))
        unknown = sorted(set(data) - set(cls.keys()))
        if unknown:
            raise ConfigError(f"unknown cost key(s) {', '.join(unknown)}; valid keys: {', '.join(cls.keys())}")
        return cls(**data)

    @classmethod
    def parse(cls, text: str) -> Costs:
        """Parse ``F=1,B=2,W=0,comm=0`` (scalars) into Costs."""
        values: dict[str, float | str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ConfigError(f"costs: expected KEY=VALUE, got {item!r} (e.g. F=1,B=2,W=0,comm=0)")
            if key.strip() in _UNITS:
                values[key.strip()] = value.strip()
                continue
            try:
                values[key.strip()] = float(value)
            except ValueError:
                raise ConfigError(f"costs: {key.strip()} must be a number, got {value.strip()!r}") from None
        return cls.from_mapping(values)

    @classmethod
    def load(cls, path: str | PathLike[str]) -> Costs:
        """From a JSON file of Costs keys, a profile (`pipeloom profile`), whose Costs keys are
        read and whose per-layer fits are left to the tuner, or a plan (`tune --output`), whose
        costs priced its schedule."""
        data = read_json(path, "costs", ConfigError)
        if isinstance(data, dict) and str(data.get("format", "")).startswith("pipeloom.profile/"):
            data = {key: value for key, value in data.items() if key in cls.keys()}
        if isinstance(data, dict) and data.get("format") == "pipeloom.plan/1":
            data = data.get("costs")
        try:
            return cls.from_mapping(data)
        except ConfigError as error:
            raise ConfigError(f"costs file {str(path)!r}: {error}") from None

    @staticmethod
    def keys() -> tuple[str, ...]:
        return tuple(field.name for field in fields(Costs))

    def to_dict(self) -> dict[str, Any]:
        """Every set key; the optional ones (T-Offload's, attention, partial recompute, link share)
        only where they differ from their defaults, so plain costs read as before."""
        defaults = {
            key: 0.0 for key in _OFFLOAD_KEYS + ("attention_fraction", "a2a_F", "a2a_B", "op_overhead", "M_shared")
        } | {
            "p2p_host_link_share": 1.0,
            "recompute_fraction": 1.0,
        }
        return {
            key: _plain(value)
            for key in self.keys()
            if (value := getattr(self, key)) is not None and not (key in defaults and value == defaults[key])
        }

    def shared_static(self, stages: Collection[int], num_stages: int) -> float:
        """What a device hosting `stages` (of `num_stages`) holds once although two of them count
        it: `M_shared` where it hosts both the first and the last stage, else nothing."""
        return self.M_shared if hosts_both_ends(stages, num_stages) else 0.0

    # -- resolution for one schedule shape -------------------------------------------------

    def stage_value(self, key: str, stage: int) -> float:
        """A per-stage key's value for `stage`, over a whole micro-batch (per-slice entries
        summed); a scalar stands for every stage."""
        value = getattr(self, key)
        if not isinstance(value, tuple):
            return float(value)
        entry = value[stage]
        return float(sum(entry)) if isinstance(entry, tuple) else float(entry)

    def resolve(self, num_devices: int, num_stages: int, num_slices: int = 1) -> StageCosts:
        """Per (stage, slice) values for a schedule of this shape (see the module docstring)."""

        def table(key: str) -> list[float]:
            return self.per_slice(key, num_devices, num_stages, num_slices)

        static = table("M_static")
        static_per_stage = [sum(static[s * num_slices : (s + 1) * num_slices]) for s in range(num_stages)]
        forward, backward, weight, recompute = table("F"), table("B"), table("W"), table("R")
        activations, kept = table("M_B"), table("M_ckpt")
        r = self.recompute_fraction
        if r < 1:  # the layers left out of the checkpoint keep their activations and are not re-run
            kept = [k + (1 - r) * a for k, a in zip(kept, activations)]
            recompute = [r * t for t in recompute]
        a2a_forward, a2a_backward = table("a2a_F"), table("a2a_B")
        if any(a2a_forward) or any(a2a_backward):  # a lone op waits for its own communication
            forward = [t + c for t, c in zip(forward, a2a_forward)]
            recompute = [t + c for t, c in zip(recompute, a2a_forward)]
            backward = [t + c for t, c in zip(backward, a2a_backward)]
        if self.op_overhead:
            more = self.op_overhead
            forward, backward, recompute = ([t + more for t in ts] for ts in (forward, backward, recompute))
            weight = [t + more if t else t for t in weight]
        if self.BW is None:
            fused = [b + w for b, w in zip(backward, weight)]
        else:  # one op: its communication and the runtime's time around it once
            fused = [t + c + self.op_overhead for t, c in zip(table("BW"), a2a_backward)]
        forward_fused = forward
        if self.F_BW is not None:
            forward_fused = [t + c + self.op_overhead for t, c in zip(table("F_BW"), a2a_forward)]
        return StageCosts(
            num_slices=num_slices,
            F=forward,
            B=backward,
            W=weight,
            R=recompute,
            M_B=activations,
            M_W=table("M_W"),
            M_ckpt=kept,
            M_static=static_per_stage,
            comm=self.comm,
            a2a_F=a2a_forward,
            a2a_B=a2a_backward,
            BW=fused,
            F_BW=forward_fused,
        )

    def per_slice(self, key: str, num_devices: int, num_stages: int, num_slices: int = 1) -> list[float]:
        """One per-stage key resolved to a list indexed by ``stage * num_slices + slice``."""
        value = getattr(self, key)
        if value is None:
            value = self.F
        weighted = self.attention_fraction > 0 and key in _ATTENTION_KEYS and num_slices > 1
        weights = self.slice_weights(num_slices) if weighted else None
        if not isinstance(value, tuple):
            if weights is None:
                share = num_devices / (num_stages * num_slices)
                return [value * share] * (num_stages * num_slices)
            return [value * num_devices / num_stages * weight for weight in weights] * num_stages
        if len(value) != num_stages:
            raise ConfigError(
                f"costs: {key} has {len(value)} per-stage values but the schedule has {num_stages} stages; "
                f"give one value per stage or a scalar (one device's share of the model)"
            )
        out: list[float] = []
        for stage, entry in enumerate(value):
            if isinstance(entry, tuple):
                if len(entry) != num_slices:
                    raise ConfigError(
                        f"costs: {key}[{stage}] has {len(entry)} per-slice values but the schedule has {num_slices} slices"
                    )
                out.extend(entry)
            elif weights is None:
                out.extend([entry / num_slices] * num_slices)
            else:
                out.extend([entry * weight for weight in weights])
        return out

    def slice_weights(self, num_slices: int) -> list[float]:
        """Each slice's share of a stage's F, B or R time (they sum to 1)."""
        a, L = self.attention_fraction, num_slices
        return [(1 - a) / L + a * (2 * index + 1) / L**2 for index in range(L)]


def causal_attention_fraction(hidden: int, seq_len: int, ffn: int | None = None) -> float:
    """FLOP share of causal attention (scores and their weighted sum) in a decoder layer.

    Per token a layer spends 2·(4h² + 3h·ffn) FLOPs in its linear layers (SwiGLU; 2·(4h² +
    2h·ffn) = 24h² for GPT's ffn = 4h with two matrices is close) and on average 2·seq·h in
    attention (QKᵀ and AV over half the sequence, causal): a = seq / (seq + 4h + 3·ffn).

    >>> round(causal_attention_fraction(5120, 4096, 13824), 3)  # LLaMA-2 13B at 4K
    0.062
    """
    ffn = 4 * hidden if ffn is None else ffn
    return seq_len / (seq_len + 4 * hidden + 3 * ffn)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _normalise(key: str, value: Any) -> float | tuple:
    """Scalars to float, lists to tuples (hashable, frozen); reject negatives and non-numbers."""
    if _is_number(value):
        if value < 0 or not math.isfinite(value):
            raise ConfigError(f"costs: {key} must be a non-negative finite number, got {value!r}")
        return float(value)
    if isinstance(value, (list, tuple)) and value:
        if all(_is_number(entry) and 0 <= entry < math.inf for entry in value):  # the usual case, at once
            return tuple(float(entry) for entry in value)
        return tuple(
            _normalise(f"{key}[{i}]", entry) if _is_number(entry) else _normalise_slices(f"{key}[{i}]", entry)
            for i, entry in enumerate(value)
        )
    raise ConfigError(f"costs: {key} must be a number or a non-empty per-stage list, got {value!r}")


def _normalise_slices(key: str, value: Any) -> tuple[float, ...]:
    if isinstance(value, (list, tuple)) and value and all(_is_number(entry) for entry in value):
        return tuple(_normalise(f"{key}[{i}]", entry) for i, entry in enumerate(value))  # type: ignore[misc]
    raise ConfigError(f"costs: {key} must be a number or a list of per-slice numbers, got {value!r}")


def _plain(value: Any) -> Any:
    return [_plain(entry) for entry in value] if isinstance(value, tuple) else value


CostsFor = Callable[[int, int], Costs]
"""(stages, slices) → the costs of a schedule of that shape: a profile priced for each schedule's
own stages (`cli.args.costs_source`)."""


def priced(build: Callable[[Costs], Schedule], costs: Costs | CostsFor) -> tuple[Schedule, Costs]:
    """The schedule `build(costs)` makes and the costs it runs on: `costs` as given, or priced for
    the shape of the schedule built on default costs (a cost-aware generator's shape does not
    depend on them), then built again with them."""
    if isinstance(costs, Costs):
        return build(costs), costs
    shape = build(Costs())
    shaped = costs(shape.num_stages, shape.num_slices)
    return build(shaped), shaped
