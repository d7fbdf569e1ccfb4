"""The profile as typed data (`pipeloom.profile/2`): what `pipeloom profile` measures and writes,
and all that `tune` reads of it.

A profile is measured once (`pipeloom.profile`, torch) and read by every later plan
(`pipeloom.tune.profiled`, torch-free), often on another day, so the two sides meet only here:
frozen dataclasses with `to_dict`/`from_dict`, the file checked entry by entry as it is read
(a file is something a user can edit, and a busy machine once wrote a negative time into one:
a NaN slips through arithmetic silently, `max(0.0, nan)` being 0). The first bad entry is named
in the error.

What a profile measured is keyed by its `Layout` — how a probe's ranks shared its stage (plain,
a stage over tp ranks with or without sequence parallelism, replicas sharing out the experts) and
in how many slices it ran each micro-batch — so the cost model selects the measurements of a
plan's layout rather than adjusting another's.
A `pipeloom.profile/1` file (the untyped dict of earlier versions) is converted on read.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from pipeloom.errors import ConfigError
from pipeloom.tune.presets import ModelSpec, model_from_config

__all__ = [
    "PROFILE_FORMAT",
    "PROFILE_FORMAT_1",
    "FIT_KINDS",
    "TIME_KINDS",
    "POSITIONS",
    "Layout",
    "Fit",
    "Speed",
    "ExpertExchange",
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
PROFILE_FORMAT_1 = "pipeloom.profile/1"
TIME_KINDS = ("F", "B", "W", "R")
"""The passes a fit prices, in ms."""
FIT_KINDS = (*TIME_KINDS, "M_B", "M_ckpt")
"""What every micro-batch size of a fitted layout holds (M_W, the bytes a B leaves queued for
its W, is optional: profiles before it was measured have none)."""
_OPTIONAL_KINDS = ("M_W",)
POSITIONS = ("first", "last", "middle", "single")
_ADVICE = "profile again (`pipeloom profile`), or correct the file"


@dataclass(frozen=True)
class Layout:
    """How a probe's ranks shared its stage, and in how many slices it ran each micro-batch.
    `key` names it in the file: "plain", "tp2", "tp2+sp", "ep2", "s4"."""

    tp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    slices: int = 1

    @property
    def key(self) -> str:
        parts = [f"tp{self.tp}{'+sp' if self.sequence_parallel else ''}"] if self.tp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"s{self.slices}"] if self.slices > 1 else []
        return ",".join(parts) or "plain"

    @classmethod
    def from_key(cls, key: str) -> Layout:
        if key == "plain":
            return cls()
        sizes = {"tp": 1, "ep": 1, "s": 1}
        sequence_parallel = False
        for part in key.split(","):
            match = re.fullmatch(r"(tp|ep|s)(\d+)(\+sp)?", part)
            if match is None or sizes[match[1]] != 1 or (match[3] and match[1] != "tp"):
                raise ConfigError(f"profile: layouts has a layout {key!r}, not plain or tpN[+sp], epN, sN; {_ADVICE}")
            sizes[match[1]], sequence_parallel = int(match[2]), sequence_parallel or bool(match[3])
        layout = cls(sizes["tp"], sequence_parallel, sizes["ep"], sizes["s"])
        if min(sizes.values()) < 1 or layout.key != key:
            raise ConfigError(f"profile: layouts has a layout {key!r}, not plain or tpN[+sp], epN, sN; {_ADVICE}")
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
        value = {
            "per_layer": self.per_layer,
            "single": self.single,
            "first": self.first,
            "last": self.last,
            "middle": self.middle,
        }[position]
        if value is None:
            raise KeyError(position)
        return value

    def to_dict(self) -> dict[str, float]:
        out = {"per_layer": self.per_layer}
        out.update({position: value for position in POSITIONS if (value := getattr(self, position)) is not None})
        return out


@dataclass(frozen=True)
class Speed:
    """How a rank's step and an op vary from step to step (`profile.speed`): quantiles of a
    step's time over its median, of an op's over its median with its step's factor taken out,
    and the mean of those op factors. Empty where too few steps were measured."""

    step: tuple[float, ...] = ()
    op: tuple[float, ...] = ()
    op_mean: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"step": list(self.step), "op": list(self.op)}
        if self.op_mean is not None:
            out["op_mean"] = self.op_mean
        return out


@dataclass(frozen=True)
class ExpertExchange:
    """One micro-batch size on the expert-parallel probe (one stage of `layers` layers, two
    replicas sharing out its experts): the all-to-alls' ms per layer of an F and of a B, the
    bytes an F stashed, an F's and a BW's whole time, and rank 0's step beyond its pipeline
    (its wait for the other replica) beside its pipeline. Older profiles measured only F and B."""

    F: float
    B: float
    layers: int | None = None
    M_B: float | None = None
    F_op: float | None = None
    BW_op: float | None = None
    tail_ms: float | None = None
    pipeline_ms: float | None = None

    def to_dict(self) -> dict[str, float]:
        names = ("F", "B", "layers", "M_B", "F_op", "BW_op", "tail_ms", "pipeline_ms")
        return {name: value for name in names if (value := getattr(self, name)) is not None}


@dataclass(frozen=True)
class LayoutProfile:
    """What the probes of one layout measured: fits per micro-batch size and kind (F, B, W, R in
    ms; M_B, M_W, M_ckpt in bytes), how their speed varied, the relative standard error of each
    op kind's medians, the layers a stage its probes ran, and (expert parallelism) the exchanges
    per size."""

    fits: Mapping[int, Mapping[str, Fit]] = field(default_factory=dict)
    speed: Speed = Speed()
    confidence: Mapping[int, Mapping[str, float]] = field(default_factory=dict)
    exchange: Mapping[int, ExpertExchange] = field(default_factory=dict)
    layers: tuple[int, ...] = ()
    """The layer counts a stage of its probes held, ascending (empty: not recorded, a profile
    from before they were)."""

    @property
    def sizes(self) -> list[int]:
        return sorted(self.fits)

    def kinds(self) -> set[str]:
        """The kinds fitted at every micro-batch size."""
        return set.intersection(*(set(kinds) for kinds in self.fits.values())) if self.fits else set()

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "fits": {
                str(size): {kind: fit.to_dict() for kind, fit in by_kind.items()} for size, by_kind in self.fits.items()
            },
            "speed": self.speed.to_dict(),
        }
        if self.confidence:
            out["confidence"] = {str(size): dict(errors) for size, errors in self.confidence.items()}
        if self.exchange:
            out["exchange"] = {str(size): value.to_dict() for size, value in self.exchange.items()}
        if self.layers:
            out["layers"] = list(self.layers)
        return out


@dataclass(frozen=True)
class Link:
    """A transfer measured at two sizes: latency + bytes / bandwidth."""

    latency_ms: float
    bytes_per_ms: float

    def ms(self, nbytes: float) -> float:
        return self.latency_ms + nbytes / self.bytes_per_ms


@dataclass(frozen=True)
class Links:
    """Send/recv between two ranks, and the collectives over `dp` ranks (None: not measured)."""

    p2p: Link
    allreduce: Link | None = None
    reduce_scatter: Link | None = None
    all_gather: Link | None = None
    dp: int = 2

    @property
    def collectives(self) -> bool:
        return None not in (self.allreduce, self.reduce_scatter, self.all_gather)

    def collective(self, name: str) -> Link:
        link = {"allreduce": self.allreduce, "reduce_scatter": self.reduce_scatter, "all_gather": self.all_gather}[name]
        if link is None:
            raise KeyError(name)
        return link


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
    of a step (None for the optimizer: an older profile lumped it into `step`)."""

    op_ms: float = 0.0
    optimizer: LinearCost | None = None
    step: LinearCost = LinearCost(0.0)


@dataclass(frozen=True)
class Params:
    """Parameters of one decoder layer (of which a MoE layer's routed experts: `experts`), and
    the first and last stages' extras (embeddings; final norm and head)."""

    layer: float
    first: float
    last: float
    experts: float = 0.0


@dataclass(frozen=True)
class DeviceInfo:
    """Where the profile was taken: "cpu" or "cuda", described for people."""

    kind: str
    description: str
    threads: int | None = None


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
    device: DeviceInfo
    dtype: str
    params: Params
    static_bytes_per_param: float
    links: Links
    overheads: Overheads
    layouts: Mapping[Layout, LayoutProfile]
    """Always "plain"; "tpN[+sp]" with `profile --tp`; "ep2" for a mixture of experts; "sN" with
    `profile --slices`."""
    replica_skew: Mapping[int, float] = field(default_factory=dict)
    """ZeRO level (0; 1 for ZeRO-1/2) → the replicas' wait at the gradient sync over the pipeline."""
    noise: Noise = Noise()
    warnings: tuple[str, ...] = ()
    source: str | None = None
    """The profiled model itself where `train --plan` can build it (hf:DIR)."""

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
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "model": self.model.to_dict(),
            "device": {"kind": self.device.kind, "description": self.device.description},
            "dtype": self.dtype,
            "params": asdict(self.params),
            "static_bytes_per_param": self.static_bytes_per_param,
            "links": _present(asdict(self.links)),
            "overheads": _present(asdict(self.overheads)),
            "layouts": {layout.key: measured.to_dict() for layout, measured in self.layouts.items()},
            "replica_skew": {str(zero): share for zero, share in self.replica_skew.items()},
            "noise": asdict(self.noise),
            "warnings": list(self.warnings),
        }
        if self.device.threads is not None:
            out["device"]["threads"] = self.device.threads
        if self.source:
            out["source"] = self.source
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Profile:
        """The profile in `data` (a `pipeloom.profile/2` dict, or a `/1` one, converted),
        checked: ConfigError naming the first entry missing, not a number, not finite,
        negative, or (a bandwidth) not positive."""
        if not isinstance(data, Mapping) or data.get("format") not in (PROFILE_FORMAT, PROFILE_FORMAT_1):
            raise ConfigError(f"not a {PROFILE_FORMAT} file (run `pipeloom profile` to make one)")
        if data["format"] == PROFILE_FORMAT_1:
            data = _from_format_1(data)
        for key in ("model", "layouts", "params", "links"):
            if key not in data:
                raise ConfigError(f"profile is incomplete: it has no {key!r} (run `pipeloom profile` to make one)")
        layouts = _mapping(data["layouts"], "layouts")
        if "plain" not in layouts:
            raise ConfigError(f"profile is incomplete: layouts has no 'plain' measurements; {_ADVICE}")
        device = data.get("device") or {}
        params = _mapping(data["params"], "params")
        links = _mapping(data["links"], "links")
        overheads = _mapping(data.get("overheads", {}), "overheads")
        optimizer = overheads.get("optimizer")
        return cls(
            model=model_from_config(data["model"]),
            device=DeviceInfo(
                str(device.get("kind", "cpu")), str(device.get("description", "")), device.get("threads")
            ),
            dtype=str(data.get("dtype", "fp32")),
            params=Params(
                **{
                    name: _non_negative(params.get(name, 0.0 if name == "experts" else None), f"params.{name}")
                    for name in ("layer", "first", "last", "experts")
                }
            ),
            static_bytes_per_param=_non_negative(data.get("static_bytes_per_param"), "static_bytes_per_param"),
            links=Links(
                p2p=_link(links.get("p2p"), "links.p2p"),
                **{
                    name: _link(links[name], f"links.{name}")
                    for name in ("allreduce", "reduce_scatter", "all_gather")
                    if links.get(name) is not None
                },
                dp=int(_positive(links.get("dp", 2), "links.dp")),
            ),
            overheads=Overheads(
                op_ms=_non_negative(overheads.get("op_ms", 0.0), "overheads.op_ms"),
                optimizer=None if optimizer is None else _linear(optimizer, "overheads.optimizer"),
                step=_linear(overheads.get("step", {"base_ms": 0.0}), "overheads.step"),
            ),
            layouts=_layouts(layouts),
            replica_skew={
                _size(zero, "replica_skew", "a ZeRO level", minimum=0): _non_negative(share, f"replica_skew.{zero}")
                for zero, share in _mapping(data.get("replica_skew", {}), "replica_skew").items()
            },
            noise=_noise(_mapping(data.get("noise", {}), "noise")),
            warnings=tuple(str(text) for text in data.get("warnings", ())),
            source=data.get("source"),
        )


def _layouts(layouts: Mapping[str, Any]) -> dict[Layout, LayoutProfile]:
    """Each layout's measurements by its key. A layout whose probes ran two stages (plain,
    sliced) has fits at every position; one over tp ranks or expert replicas ran one stage, and
    has the single stage's."""
    out = {}
    for key, value in layouts.items():
        layout = Layout.from_key(key)
        out[layout] = _layout_profile(value, f"layouts.{key}", fitted=layout.tp == 1 and layout.ep == 1)
    return out


def _present(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields that hold a value (a link or an optimizer fit not measured is left out)."""
    return {name: value for name, value in fields.items() if value is not None}


# -- reading, entry by entry ---------------------------------------------------------------------


def _number(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"profile: {where} must be a number, got {value!r}; {_ADVICE}")
    if not math.isfinite(value):
        raise ConfigError(f"profile: {where} is {value!r}, not a finite number; {_ADVICE}")
    return float(value)


def _non_negative(value: Any, where: str) -> float:
    number = _number(value, where)
    if number < 0:
        raise ConfigError(f"profile: {where} is {value!r}: a measured time or size cannot be negative; {_ADVICE}")
    return number


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise ConfigError(f"profile: {where} is {value!r}: it must be positive; {_ADVICE}")
    return number


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"profile: {where} must be a JSON object, got {value!r}; {_ADVICE}")
    return value


def _size(key: Any, where: str, what: str = "a micro-batch size", minimum: int = 1) -> int:
    if not (isinstance(key, str) and key.isdigit() and int(key) >= minimum):
        bound = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ConfigError(f"profile: {where} has {what} {key!r}, not {bound}; {_ADVICE}")
    return int(key)


def _link(value: Any, where: str) -> Link:
    link = _mapping(value, where)
    return Link(
        _non_negative(link.get("latency_ms"), f"{where}.latency_ms"),
        _positive(link.get("bytes_per_ms"), f"{where}.bytes_per_ms"),
    )


def _linear(value: Any, where: str) -> LinearCost:
    fit = _mapping(value, where)
    return LinearCost(
        _non_negative(fit.get("base_ms"), f"{where}.base_ms"),
        _non_negative(fit.get("per_param_ms", 0.0), f"{where}.per_param_ms"),
    )


def _fit(value: Any, where: str, positions: tuple[str, ...]) -> Fit:
    if not isinstance(value, Mapping):
        raise ConfigError(f"profile: {where} is missing or not a fit, got {value!r}; {_ADVICE}")
    present = {name: _non_negative(value.get(name), f"{where}.{name}") for name in ("per_layer", *positions)}
    optional = {name: _non_negative(value[name], f"{where}.{name}") for name in POSITIONS if name in value}
    return Fit(**(optional | present))


def _fits(value: Any, where: str, fitted: bool) -> dict[int, dict[str, Fit]]:
    """Micro-batch size → kind → Fit; a two-stage layout (`fitted`: plain, sliced) has every
    kind of `FIT_KINDS` at every position."""
    if not isinstance(value, Mapping) or (fitted and not value):
        raise ConfigError(
            f"profile: {where}: `fits` must map micro-batch sizes to measurements, got {value!r}; {_ADVICE}"
        )
    out: dict[int, dict[str, Fit]] = {}
    for size, by_kind in value.items():
        here = f"{where}.fits[{size}]" if where else f"fits[{size}]"
        number = _size(size, f"{where}.fits" if where else "fits")
        if not isinstance(by_kind, Mapping):
            raise ConfigError(f"profile: {here} must hold the measured fits, got {by_kind!r}; {_ADVICE}")
        positions = POSITIONS if fitted else ("single",)
        kinds = [*FIT_KINDS, *(kind for kind in _OPTIONAL_KINDS if kind in by_kind)] if fitted else list(by_kind)
        unknown = set(by_kind) - set(FIT_KINDS) - set(_OPTIONAL_KINDS)
        if unknown:
            raise ConfigError(
                f"profile: {here} has {sorted(unknown)}, not among {[*FIT_KINDS, *_OPTIONAL_KINDS]}; {_ADVICE}"
            )
        out[number] = {kind: _fit(by_kind.get(kind), f"{here}.{kind}", positions) for kind in kinds}
    return out


def _speed(value: Any, where: str) -> Speed:
    speed = _mapping(value, where)

    def factors(name: str) -> tuple[float, ...]:
        return tuple(_positive(v, f"{where}.{name}") for v in speed.get(name) or ())

    mean = speed.get("op_mean")
    return Speed(factors("step"), factors("op"), None if mean is None else _positive(mean, f"{where}.op_mean"))


def _layout_profile(value: Any, where: str, fitted: bool) -> LayoutProfile:
    measured = _mapping(value, where)
    confidence = _mapping(measured.get("confidence", {}), f"{where}.confidence")
    exchange = _mapping(measured.get("exchange", {}), f"{where}.exchange")
    return LayoutProfile(
        fits=_fits(measured.get("fits", {}), where, fitted),
        speed=_speed(measured.get("speed", {}), f"{where}.speed"),
        confidence={
            _size(size, f"{where}.confidence"): {
                kind: _non_negative(error, f"{where}.confidence[{size}].{kind}")
                for kind, error in _mapping(errors, f"{where}.confidence[{size}]").items()
            }
            for size, errors in confidence.items()
        },
        exchange={
            _size(size, f"{where}.exchange"): _exchange(v, f"{where}.exchange[{size}]") for size, v in exchange.items()
        },
        layers=_layer_counts(measured.get("layers", []), f"{where}.layers"),
    )


def _layer_counts(value: Any, where: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in value):
        raise ConfigError(f"profile: {where} must be a list of layer counts, got {value!r}; {_ADVICE}")
    if any(n < 1 for n in value):
        raise ConfigError(f"profile: {where} holds {min(value)}: a probe's stage holds at least one layer; {_ADVICE}")
    return tuple(sorted(set(value)))


def _exchange(value: Any, where: str) -> ExpertExchange:
    entry = _mapping(value, where)
    optional = {
        name: _non_negative(entry[name], f"{where}.{name}")
        for name in ("M_B", "F_op", "BW_op", "tail_ms", "pipeline_ms")
        if entry.get(name) is not None
    }
    layers = entry.get("layers")
    return ExpertExchange(
        F=_non_negative(entry.get("F"), f"{where}.F"),
        B=_non_negative(entry.get("B"), f"{where}.B"),
        layers=None if layers is None else int(_positive(layers, f"{where}.layers")),
        **optional,
    )


def _noise(noise: Mapping[str, Any]) -> Noise:
    known = {name: noise[name] for name in Noise.__dataclass_fields__ if noise.get(name) is not None}
    return Noise(**known)


def _without(value: Any, key: str) -> Any:
    return {k: v for k, v in value.items() if k != key} if isinstance(value, Mapping) else value


# -- pipeloom.profile/1 ---------------------------------------------------------------------------


def _from_format_1(old: Mapping[str, Any]) -> dict[str, Any]:
    """A `/1` profile (the flat dict of earlier versions) as `/2`: its fits, speeds and
    confidence under the plain layout, `tensor_parallel[*]` under "tpN[+sp]", `a2a` under
    "ep2", the links and overheads grouped. Only the reading moves; no number changes (a `/1`
    file without a p2p link keeps its bandwidth, latency 0)."""

    def speed(source: Mapping[str, Any]) -> dict[str, Any]:
        return {"step": source.get("step_speed") or [], "op": source.get("op_speed") or []} | (
            {"op_mean": source["op_speed_mean"]} if source.get("op_speed_mean") is not None else {}
        )

    if "fits" not in old:
        raise ConfigError("profile is incomplete: it has no 'fits' (run `pipeloom profile` to make one)")
    fits = old["fits"]
    if isinstance(fits, Mapping):  # each size's p2p time: the p2p link prices it now
        fits = {size: _without(by_kind, "p2p_ms") for size, by_kind in fits.items()}
    layouts: dict[str, Any] = {"plain": {"fits": fits, "speed": speed(old), "confidence": old.get("confidence") or {}}}
    tp_speeds = old.get("tensor_parallel_speed") or {}
    tp_fits = _mapping(old.get("tensor_parallel", {}), "tensor_parallel")
    for key in {*tp_fits, *tp_speeds}:
        layouts["tp" + key] = {"fits": tp_fits.get(key, {}), "speed": speed(tp_speeds.get(key) or {})}
    if "a2a" in old or old.get("expert_parallel_speed"):
        a2a = _mapping(old.get("a2a", {}), "a2a")
        exchange = {size: value for size, value in a2a.items() if size != "ep"}
        layouts[f"ep{a2a.get('ep', 2)}"] = {
            "exchange": exchange,
            "speed": speed(old.get("expert_parallel_speed") or {}),
        }
    p2p = old.get("p2p") or {"latency_ms": 0.0, "bytes_per_ms": old.get("p2p_bandwidth")}
    links = {"p2p": p2p} | {name: old[name] for name in ("allreduce", "reduce_scatter", "all_gather") if name in old}
    if isinstance(old.get("allreduce"), Mapping):
        links["dp"] = old["allreduce"].get("dp", 2)
    overheads = {"op_ms": old.get("op_overhead_ms", 0.0), "step": old.get("step_overhead", {"base_ms": 0.0})}
    if old.get("optimizer") is not None:
        overheads["optimizer"] = old["optimizer"]
    device = str(old.get("device", ""))
    return {
        "format": PROFILE_FORMAT,
        "model": old.get("model"),
        "device": {"kind": "cuda" if device.startswith("cuda") else "cpu", "description": device},
        "dtype": old.get("dtype", "fp32"),
        "params": old.get("params"),
        "static_bytes_per_param": old.get("static_bytes_per_param"),
        "links": links,
        "overheads": overheads,
        "layouts": layouts,
        "replica_skew": old.get("replica_skew") or {},
        "noise": old.get("noise") or {},
        "warnings": old.get("warnings") or [],
        "source": old.get("source"),
    }
