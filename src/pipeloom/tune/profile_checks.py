"""A profile's numbers checked on load, as Costs checks its own: every time and size finite and
not negative, every rate positive, the shape the tuner reads.

A profile is a file a user can edit, and one a busy machine once wrote a negative time into. A
NaN slips through arithmetic silently (`max(0.0, nan)` is 0: a NaN forward became F = 0 in a
plan), so each entry is checked by name before any of it is used, and the error says which.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipeloom.errors import ConfigError

__all__ = ["check_profile_numbers", "FIT_KEYS", "FIT_FIELDS"]

FIT_KEYS = ("F", "B", "W", "R", "M_B", "M_ckpt")
"""What each micro-batch size's fit prices (times in ms, memory in bytes)."""
FIT_FIELDS = ("per_layer", "first", "last", "middle", "single")
"""A slope per layer and an intercept per stage position."""
_ADVICE = "profile again (`pipeloom profile`), or correct the file"


def check_profile_numbers(profile: Mapping[str, Any]) -> None:
    """ConfigError naming the first entry that is missing, not a number, not finite, negative
    (or, for a rate, not positive)."""
    fits = profile.get("fits")
    if not isinstance(fits, Mapping) or not fits:
        raise ConfigError(f"profile: `fits` must map micro-batch sizes to measurements, got {fits!r}; {_ADVICE}")
    for size, fit in fits.items():
        if not (isinstance(size, str) and size.isdigit() and int(size) >= 1):
            raise ConfigError(f"profile: fits has a micro-batch size {size!r}, not a positive integer; {_ADVICE}")
        if not isinstance(fit, Mapping):
            raise ConfigError(f"profile: fits[{size}] must hold the measured fits, got {fit!r}; {_ADVICE}")
        for key in FIT_KEYS:
            entry = fit.get(key)
            if not isinstance(entry, Mapping):
                raise ConfigError(f"profile: fits[{size}].{key} is missing or not a fit, got {entry!r}; {_ADVICE}")
            for field in FIT_FIELDS:
                _non_negative(entry.get(field), f"fits[{size}].{key}.{field}")
        if "p2p_ms" in fit:
            _non_negative(fit["p2p_ms"], f"fits[{size}].p2p_ms")
    _non_negative(profile.get("static_bytes_per_param"), "static_bytes_per_param")
    _positive(profile.get("p2p_bandwidth"), "p2p_bandwidth")
    _non_negative(profile.get("op_overhead_ms", 0.0), "op_overhead_ms")
    for name in ("step_overhead", "optimizer"):
        fit = profile.get(name)
        if fit is None:  # older profiles: no step overhead, or the optimizer inside it
            continue
        if not isinstance(fit, Mapping):
            raise ConfigError(f"profile: {name} must hold base_ms and per_param_ms, got {fit!r}; {_ADVICE}")
        for field in ("base_ms", "per_param_ms"):
            _non_negative(fit.get(field), f"{name}.{field}")
    _check_tensor_parallel(profile.get("tensor_parallel", {}))


def _check_tensor_parallel(layouts: Any) -> None:
    """The ops measured on tp ranks: layout ("2", "2+sp") → micro-batch size → pass → fit."""
    if not isinstance(layouts, Mapping):
        raise ConfigError(f"profile: tensor_parallel must map layouts to fits, got {layouts!r}; {_ADVICE}")
    for layout, by_size in layouts.items():
        if not isinstance(by_size, Mapping) or not by_size:
            raise ConfigError(f"profile: tensor_parallel[{layout}] must map micro-batch sizes to fits; {_ADVICE}")
        for size, fits in by_size.items():
            where = f"tensor_parallel[{layout}][{size}]"
            if not isinstance(fits, Mapping) or not all(isinstance(fit, Mapping) for fit in fits.values()):
                raise ConfigError(f"profile: {where} must hold the measured fits, got {fits!r}; {_ADVICE}")
            for kind, fit in fits.items():
                for field in ("per_layer", "single"):
                    _non_negative(fit.get(field), f"{where}.{kind}.{field}")


def _number(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise ConfigError(f"profile: {where} must be a number, got {value!r}; {_ADVICE}")
    if not math.isfinite(value):
        raise ConfigError(f"profile: {where} is {value!r}, not a finite number; {_ADVICE}")
    return float(value)


def _non_negative(value: Any, where: str) -> None:
    if _number(value, where) < 0:
        raise ConfigError(f"profile: {where} is {value!r}: a measured time or size cannot be negative; {_ADVICE}")


def _positive(value: Any, where: str) -> None:
    if _number(value, where) <= 0:
        raise ConfigError(f"profile: {where} is {value!r}: it must be positive; {_ADVICE}")
