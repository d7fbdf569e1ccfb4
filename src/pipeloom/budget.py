"""Memory budgets as users write them: one number for every device or one per device.

A plain number is in the costs' memory unit (M_B = 1 by default, so ``16`` means sixteen
micro-batches' activations of one device's share); a number with a byte suffix (``40GiB``,
``512MB``) is converted to bytes, for costs whose memory is given in bytes.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from pipeloom.errors import ConfigError

__all__ = ["budget_from_flag", "check_within_budget", "parse_memory_budget", "per_device"]

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_AMOUNT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_memory_budget(text: str) -> float | list[float]:
    """``"16"`` → 16.0; ``"40GiB"`` → bytes; ``"8,8,6,6"`` → one budget per device.

    >>> parse_memory_budget("1.5GiB,1GiB")
    [1610612736.0, 1073741824.0]
    """
    values = [_amount(part, text) for part in text.split(",")]
    return values[0] if len(values) == 1 else values


def _amount(part: str, whole: str) -> float:
    match = _AMOUNT.match(part)
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise ConfigError(
            f"memory budget {whole!r}: expected a number (costs' memory unit) or a size like 40GiB, "
            "optionally one per device separated by commas"
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"memory budget {whole!r}: budgets must be positive")
    return value


def budget_from_flag(text: str | None, costs_in_bytes: bool) -> float | list[float] | None:
    """`--mem-limit` as the commands take it: a size with a byte suffix only for costs in bytes
    (a profile); with unit-less costs it would silently mean nothing."""
    if not text:
        return None
    budget = parse_memory_budget(text)
    sized = any((match := _AMOUNT.match(part)) and match.group(2) for part in text.split(","))
    if sized and not costs_in_bytes:
        raise ConfigError(
            f"--mem-limit {text!r} is a size in bytes, but the costs are unit-less (M_B = 1 per micro-batch): "
            "give a plain number in the costs' memory unit, or costs in bytes (--costs profile.json)"
        )
    return budget


def check_within_budget(peaks, budget: float | list[float] | None, what: str) -> None:
    """Refuse a result whose peak activation memory breaks the budget it was built for, naming
    the device and by how much."""
    if budget is None:
        return
    limits = budget if isinstance(budget, list) else [budget] * len(peaks)
    over = [(peak - limit, device, peak, limit) for device, (peak, limit) in enumerate(zip(peaks, limits))]
    excess, device, peak, limit = max(over)
    if excess > 1e-9 * max(1.0, limit):
        raise ConfigError(
            f"{what} breaks --mem-limit: device {device} peaks at {peak:g} of activation memory, "
            f"{excess:g} over its limit {limit:g}"
        )


def per_device(
    budget: float | Sequence[float] | None, num_devices: int, what: str, unlimited: float | None = math.inf
) -> list[float]:
    """A budget as one limit per device: a number is every device's; a sequence must have one
    entry per device; None is `unlimited` on every device. `what` names the caller in errors."""
    if budget is None:
        if unlimited is None:
            raise ConfigError(f"{what}: a memory limit is needed")
        return [unlimited] * num_devices
    if isinstance(budget, (int, float)):
        return [float(budget)] * num_devices
    limits = [float(x) for x in budget]
    if len(limits) != num_devices:
        raise ConfigError(
            f"{what}: {len(limits)} memory limits given for {num_devices} devices; give one or one per device"
        )
    return limits
