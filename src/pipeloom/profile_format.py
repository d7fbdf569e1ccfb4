"""The profile as typed data (`pipeloom.profile/2`): what `pipeloom profile` measures and writes,
and all that `tune` reads of it.

A profile is measured once (`pipeloom.profile`, torch) and read by every later plan
(`pipeloom.tune.profiled`, torch-free), often on another day, so the two sides meet only here:
frozen dataclasses with `to_dict`/`from_dict`, the file checked entry by entry as it is read
(a file is something a user can edit, and a NaN slips through arithmetic silently,
`max(0.0, nan)` being 0). The first bad entry is named in the error.

What a profile measured is keyed by its `Layout` — how a probe's ranks shared its stage (plain,
a stage over tp ranks with or without sequence parallelism, replicas sharing out the experts) and
in how many slices it ran each micro-batch — so the cost model selects the measurements of a
plan's layout rather than adjusting another's.
A `pipeloom.profile/1` file (the untyped dict of earlier versions) is refused with the command
that measures a new one.
"""

from __future__ import annotations

import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from typing import Any

from pipeloom.errors import ConfigError
from pipeloom.tune.presets import ModelSpec, model_from_config

__all__ = [
    "PROFILE_FORMAT",
    "FIT_KINDS",
    "TIME_KINDS",
    "POSITIONS",
    "Layout",
    "Fit",
    "Speed",
    "ReplicaWait",
    "LayoutProfile",
    "Link",
    "Links",
    "LinearCost",
    "Overheads",
    "Params",
    "DeviceInfo",
    "Noise",
    "Profile",
]

PROFILE_FORMAT = "pipeloom.profile/2"
TIME_KINDS = ("F", "B", "W", "R")
"""The passes a fit prices, in ms."""
FIT_KINDS = (*TIME_KINDS, "M_B", "M_W", "M_ckpt")
"""What every micro-batch size of a two-stage layout holds (M_W: the bytes a B leaves queued for
its W)."""
_OPTIONAL_KINDS = ("BW", "F_BW", "a2a_F", "a2a_B", "sync")
"""BW: a fused backward (ms), input and weight gradients in one autograd pass, and F_BW the
forward of its micro-batch, its linears ordinary (absent from profiles taken before they were
measured: priced as B + W and F); a2a_F, a2a_B: the expert all-to-alls in
flight in a forward and a backward (ms), where the experts were shared out; sync: a one-stage
layout's sync phase (ms), what its ranks sum after the pipeline — under sequence parallelism, the
weights each tp rank holds whole."""
POSITIONS = ("first", "last", "middle", "single")
_ADVICE = "profile again (`pipeloom profile`), or correct the file"


@dataclass(frozen=True)
class Layout:
    """How a probe's ranks shared its stage, and in how many slices it ran each micro-batch.
    `key` names it in the file: "plain", "tp2", "tp2+sp", "ep2", "s4", "cp2"."""

    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    slices: int = 1
    cp: int = 1

    @property
    def key(self) -> str:
        parts = [f"tp{self.tp}{'+sp' if self.sequence_parallel else ''}"] if self.tp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"s{self.slices}"] if self.slices > 1 else []
        parts += [f"cp{self.cp}"] if self.cp > 1 else []
        return ",".join(parts) or "plain"

    @property
    def stages(self) -> int:
        """The stages its probes run: one over the ranks of tp, ep or cp, else two (first and last)."""
        return 1 if self.tp > 1 or self.ep > 1 or self.cp > 1 else 2

    @classmethod
    def from_key(cls, key: str) -> Layout:
        """The layout `key` names; ConfigError unless it is exactly a layout's key."""
        sizes = {"tp": 1, "ep": 1, "s": 1, "cp": 1}
        parts = [re.fullmatch(r"(tp|ep|s|cp)(\d+)(\+sp)?", part) for part in key.split(",")] if key != "plain" else []
        for match in parts:
            if match is not None:
                sizes[match[1]] = int(match[2])
        layout = cls(sizes["tp"], any(m is not None and m[3] for m in parts), sizes["ep"], sizes["s"], sizes["cp"])
        if None in parts or min(sizes.values()) < 1 or layout.key != key:
            raise ConfigError(f"profile: layouts has a layout {key!r}, not plain or tpN[+sp], epN, sN, cpN; {_ADVICE}")
        return layout


@dataclass(frozen=True)
class Fit:
    """One measured quantity of a stage, fitted over its layers: value = per_layer·n + the
    intercept of the stage's position. A probe of one stage measures `single` only."""

    per_layer: float
    single: float
    first: float | None = None
    last: float | None = None
    middle: float | None = None

    def at(self, position: str) -> float:
        """The intercept at `position` ("per_layer" for the slope); KeyError where not measured."""
        value = getattr(self, position) if position in ("per_layer", *POSITIONS) else None
        if value is None:
            raise KeyError(position)
        return value


@dataclass(frozen=True)
class Speed:
    """How a rank's step and an op vary from step to step (`profile.speed`): quantiles of a
    step's time over its median, of an op's over its median with its step's factor taken out,
    and the mean of those op factors. Empty where too few steps were measured."""

    step: tuple[float, ...] = ()
    op: tuple[float, ...] = ()
    op_mean: float | None = None


@dataclass(frozen=True)
class ReplicaWait:
    """Two data-parallel replicas of one stage of `layers` layers, in ms (medians over steps)."""

    pipeline_ms: float
    """Rank 0's pipeline."""
    layers: int
    skew_ms: float
    """How far the later replica's pipeline ends past the two's mean, half their difference: what
    every replica's collectives wait for, the step running to the later pipeline's end while a
    plan is priced at a typical one's."""
    overhead_ms: float
    """Rank 0's rest of a step: the batch, the loss's all-reduce and, unlike a probe without
    replicas, zeroing the gradient buffers the replicas sum in place and waiting there for the
    other replica's optimizer step (`Overheads.step` is fitted from both)."""


@dataclass(frozen=True)
class LayoutProfile:
    """What the probes of one layout measured: fits per micro-batch size and kind (F, B, W, R and
    the all-to-alls in flight in ms; M_B, M_W, M_ckpt in bytes), how their speed varied, the
    relative standard error of each op kind's medians, the layers a stage its probes ran, and
    its replicas' wait at the gradient sync by the ZeRO level it was measured at (0: the skew
    is the pipelines', the same at every level)."""

    fits: Mapping[int, Mapping[str, Fit]] = field(default_factory=dict)
    speed: Speed = Speed()
    confidence: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    waits: Mapping[int, ReplicaWait] = field(default_factory=dict)
    layers: tuple[int, ...] = ()
    """The layer counts a stage of its probes held, ascending (empty: not recorded, a profile
    from before they were)."""

    @property
    def sizes(self) -> list[int]:
        return sorted(self.fits)

    def kinds(self) -> set[str]:
        """The kinds fitted at every micro-batch size."""
        return set.intersection(*(set(kinds) for kinds in self.fits.values())) if self.fits else set()


@dataclass(frozen=True)
class Link:
    """A transfer measured at two sizes: latency + bytes / bandwidth."""

    latency_ms: float
    bytes_per_ms: float

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


@dataclass(frozen=True)
class Links:
    """Send/recv between two ranks, and the collectives over `dp` ranks."""

    p2p: Link
    allreduce: Link
    reduce_scatter: Link
    all_gather: Link
    dp: int = 2
    sync_contention: float | None = None
    """The share of an all-reduce's time that compute running beside it loses (on CPU ranks gloo
    sums on the cores the ops run on), from 0 (free) to 1; None: not measured."""

    def collective(self, name: str) -> Link:
        return {"allreduce": self.allreduce, "reduce_scatter": self.reduce_scatter, "all_gather": self.all_gather}[name]


@dataclass(frozen=True)
class LinearCost:
    """base_ms + per_param_ms × parameters."""

    base_ms: float
    per_param_ms: float = 0.0

    def ms(self, params: float) -> float:
        return self.base_ms + self.per_param_ms * params


@dataclass(frozen=True)
class Overheads:
    """What the runtime adds beyond the ops: a per-op overhead, the optimizer step, and the rest
    of a step."""

    optimizer: LinearCost
    op_ms: float = 0.0
    step: LinearCost = LinearCost(0.0)
    """Its parameters: those whose gradients a device's buffers hold for its replicas to sum in
    place, zeroed at each step's start (none on a device without replicas)."""


@dataclass(frozen=True)
class Params:
    """Parameters of one decoder layer (of which a MoE layer's routed experts: `experts`), the
    first and last stages' extras (embeddings; final norm and head), and of those the ones both
    ends hold (`tied`: a tied embedding, one object on a device that hosts both ends)."""

    layer: float
    first: float
    last: float
    experts: float = 0.0
    tied: float = 0.0
    moe_block: float = 0.0
    """Of `layer`, a MoE layer's whole block — router, routed and shared experts — which the
    runtime runs whole on every tensor-parallel rank (0: a dense model, or not recorded)."""


@dataclass(frozen=True)
class DeviceInfo:
    """Where the profile was taken: "cpu" or "cuda", described for people."""

    kind: str = "cpu"
    description: str = ""
    threads: int | None = None
    """Torch threads per rank (CPU)."""
    cores: int | None = None
    """The cores its ranks could run on (CPU; None: not recorded): a plan of more ranks × threads
    than this shares them, each op slower than profiled."""


@dataclass(frozen=True)
class Noise:
    """How noisy the machine was while measured: the op times' spread (interquartile range over
    median) over probes, rounds, the share of steps kept as steady, medians never settled, and
    the contention check's figures (wall over CPU time, busy rounds)."""

    median_spread: float = 0.0
    worst_spread: float = 0.0
    rounds: int = 0
    probes: int = 0
    steady_share: float = 1.0
    unsettled: int = 0
    wall_over_cpu: float | None = None
    busy_rounds: int = 0
    busy_limit: float | None = None
    busy_allowed: bool = False


@dataclass(frozen=True)
class Profile:
    model: ModelSpec
    params: Params
    static_bytes_per_param: float
    links: Links
    layouts: Mapping[Layout, LayoutProfile]
    """Always "plain"; "tpN[+sp]" with `profile --tp`; "ep2" for a mixture of experts; "sN" with
    `profile --slices`."""
    overheads: Overheads
    device: DeviceInfo = DeviceInfo()
    dtype: str = "fp32"
    noise: Noise = Noise()
    warnings: tuple[str, ...] = ()
    source: str | None = None
    """The profiled model itself where `train --plan` can build it (hf:DIR)."""
    data: str | None = None
    """What its probes trained on (`profile --data`), described; None: synthetic tokens."""

    @property
    def plain(self) -> LayoutProfile:
        return self.layouts[Layout()]

    def layout(self, layout: Layout) -> LayoutProfile | None:
        return self.layouts.get(layout)

    @property
    def expert_parallel(self) -> tuple[int, LayoutProfile] | None:
        """(ep, its measurements) of the expert-parallel layout, if measured."""
        for layout, measured in self.layouts.items():
            if layout.ep > 1 and layout.tp == 1:
                return layout.ep, measured
        return None

    def sliced(self, slices: int) -> LayoutProfile | None:
        """The plain probes run in `slices` slices, if measured (`profile --slices`)."""
        return self.layouts.get(Layout(slices=slices)) if slices > 1 else None

    def to_dict(self) -> dict[str, Any]:
        return {"format": PROFILE_FORMAT, **_plain(self), "model": self.model.to_dict()}

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """The profile in `data` (a `pipeloom.profile/2` dict), checked: ConfigError naming the
        first entry missing, not a number, not finite, negative, or (a bandwidth, a speed factor)
        not positive."""
        if isinstance(data, Mapping) and data.get("format") == "pipeloom.profile/1":
            model = data.get("source") or "MODEL"  # hf:DIR where it profiled one
            raise ConfigError(
                "a pipeloom.profile/1 file, written by an earlier pipeloom: measure this machine again "
                f"(`pipeloom profile --model {model} --output profile.json`)"
            )
        if not isinstance(data, Mapping) or (found := data.get("format")) != PROFILE_FORMAT:
            kind = f", but a {found} one" if isinstance(data, Mapping) and isinstance(found, str) else ""
            raise ConfigError(f"not a {PROFILE_FORMAT} file{kind} (run `pipeloom profile` to make one)")
        for key in ("model", "layouts", "params", "links"):
            if key not in data:
                raise ConfigError(f"profile is incomplete: it has no {key!r} (run `pipeloom profile` to make one)")
        if "plain" not in _mapping(data["layouts"], "layouts"):
            raise ConfigError(f"profile is incomplete: layouts has no 'plain' measurements; {_ADVICE}")
        return _read(cls, {key: value for key, value in data.items() if key != "format"}, "")


def _plain(value: Any) -> Any:
    """`value` as JSON data: a dataclass as the object of its fields that hold a value, a layout
    by its key, every map's keys as text, a tuple as a list."""
    if isinstance(value, Layout):
        return value.key
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(v) for f in fields(value) if (v := getattr(value, f.name)) is not None}
    if isinstance(value, Mapping):
        return {str(_plain(key)): _plain(v) for key, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


# -- reading, entry by entry ---------------------------------------------------------------------

_POSITIVE = frozenset({"bytes_per_ms", "dp", "step", "op", "op_mean", "layers", "pipeline_ms"})
"""Fields that must be above zero: a bandwidth, a group, a speed factor, a stage's layers, a
pipeline's time (a share is taken of it)."""


def _read(cls: type, value: Any, where: str) -> Any:
    """The dataclass `cls` from the JSON object `value`, each field checked by its type: a
    number finite and not negative (positive where `_POSITIVE`), a missing field its default."""
    data = _mapping(value, where)
    hints = _hints(cls)
    out = {}
    for entry in fields(cls):
        place = f"{where}.{entry.name}" if where else entry.name
        if data.get(entry.name) is None:
            if entry.default is MISSING and entry.default_factory is MISSING:
                raise ConfigError(f"profile: {place} is missing; {_ADVICE}")
            continue
        out[entry.name] = _entry(hints[entry.name], data[entry.name], place, entry.name)
    return cls(**out)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """`cls`'s field types, evaluated once (the annotations are strings)."""
    return typing.get_type_hints(cls)


def _entry(kind: Any, value: Any, where: str, name: str) -> Any:
    """`value` read as `kind` (`_read`'s checks); `name`: the field it is, or is within."""
    origin = typing.get_origin(kind)
    if origin in (typing.Union, types.UnionType):
        kind = next(option for option in typing.get_args(kind) if option is not type(None))
        origin = typing.get_origin(kind)
    if kind is ModelSpec:
        return model_from_config(value)
    if isinstance(kind, type) and is_dataclass(kind):
        return _read(kind, value, where)
    if origin is Mapping:
        key, item = typing.get_args(kind)
        entries = _mapping(value, where).items()
        if key is Layout:
            return {Layout.from_key(k): _layout_profile(k, v) for k, v in entries}
        if key is str:
            return {k: _entry(item, v, f"{where}.{k}", name) for k, v in entries}
        return {_integer_key(k, where, name): _entry(item, v, f"{where}[{k}]", name) for k, v in entries}
    if origin is tuple:
        if not isinstance(value, list):
            raise ConfigError(f"profile: {where} must be a list, got {value!r}; {_ADVICE}")
        return tuple(_entry(typing.get_args(kind)[0], item, where, name) for item in value)
    if kind is str:
        return str(value)
    if kind is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"profile: {where} must be true or false, got {value!r}; {_ADVICE}")
        return value
    number = _number(value, where, positive=name in _POSITIVE)
    if kind is int:
        if number != int(number):
            raise ConfigError(f"profile: {where} is {value!r}, not a whole number; {_ADVICE}")
        return int(number)
    return number


def _integer_key(key: Any, where: str, name: str) -> int:
    """A map's key: a micro-batch size (positive), or a ZeRO level (`waits`: from 0)."""
    what, minimum = ("a ZeRO level", 0) if name == "waits" else ("a micro-batch size", 1)
    if not (isinstance(key, str) and key.isdigit() and int(key) >= minimum):
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"profile: {where} has {what} {key!r}, not {bound}; {_ADVICE}")
    return int(key)


def _number(value: Any, where: str, positive: bool) -> float:
    """A finite number, not negative (above zero if `positive`)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"profile: {where} must be a number, got {value!r}; {_ADVICE}")
    if not math.isfinite(value):
        raise ConfigError(f"profile: {where} is {value!r}, not a finite number; {_ADVICE}")
    if positive and value <= 0:
        raise ConfigError(f"profile: {where} is {value!r}: it must be positive; {_ADVICE}")
    if value < 0:
        raise ConfigError(f"profile: {where} is {value!r}: a measured time or size cannot be negative; {_ADVICE}")
    return float(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"profile: {where} must be a JSON object, got {value!r}; {_ADVICE}")
    return value


def _layout_profile(key: str, value: Any) -> LayoutProfile:
    """A layout's measurements, read by their types, and whole: the kinds known, and a two-stage
    layout's (plain, sliced) every kind of `FIT_KINDS` at every position of every size."""
    where, two_stages = f"layouts.{key}", Layout.from_key(key).stages == 2
    known = {*FIT_KINDS, *_OPTIONAL_KINDS}
    for size, by_kind in _mapping(_mapping(value, where).get("fits", {}), f"{where}.fits").items():
        if isinstance(by_kind, Mapping) and (unknown := set(by_kind) - known):
            raise ConfigError(
                f"profile: {where}.fits[{size}] has {sorted(unknown)}, not among {sorted(known)}; {_ADVICE}"
            )
    measured = _read(LayoutProfile, value, where)
    if two_stages and not measured.fits:
        raise ConfigError(f"profile: {where}: `fits` must map micro-batch sizes to measurements; {_ADVICE}")
    for size, by_kind in measured.fits.items():
        for kind in FIT_KINDS if two_stages else ():
            fit = by_kind.get(kind)
            gap = next((f".{p}" for p in POSITIONS if getattr(fit, p) is None), None) if fit else ""
            if gap is not None:
                raise ConfigError(f"profile: {where}.fits[{size}].{kind}{gap} is missing; {_ADVICE}")
    return measured
