"""One registry of schedule generators: name → builder, paper, domain.

Each family module registers its generators on import; `build_schedule` is the one entry point
users, the CLI and the tuner call. Arguments outside a generator's domain raise ConfigError
stating the rule and the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pipeloom.errors import ConfigError
from pipeloom.ir.schedule import Schedule

__all__ = ["GeneratorInfo", "register", "build_schedule", "get_generator", "list_generators", "require_int"]


@dataclass(frozen=True, slots=True)
class GeneratorInfo:
    name: str
    build: Callable[..., Schedule]
    family: str
    paper: str
    """Short citation of where the scheme comes from."""
    summary: str
    domain: str
    """Which (p, m, options) the generator accepts, in words."""
    options: tuple[str, ...] = ()
    """Keyword arguments beyond num_devices and num_microbatches."""


_GENERATORS: dict[str, GeneratorInfo] = {}


def register(
    name: str, *, family: str, paper: str, summary: str, domain: str, options: tuple[str, ...] = ()
) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    def decorate(build: Callable[..., Schedule]) -> Callable[..., Schedule]:
        if name in _GENERATORS:
            raise RuntimeError(f"schedule generator {name!r} registered twice")
        _GENERATORS[name] = GeneratorInfo(name, build, family, paper, summary, domain, options)
        return build

    return decorate


def list_generators() -> list[GeneratorInfo]:
    return list(_GENERATORS.values())


def get_generator(name: str) -> GeneratorInfo:
    try:
        return _GENERATORS[name]
    except KeyError:
        raise ConfigError(f"unknown schedule {name!r}; known: {', '.join(_GENERATORS)}") from None


def build_schedule(name: str, num_devices: int, num_microbatches: int, **generator_kwargs: Any) -> Schedule:
    """Build the named schedule for `num_devices` devices and `num_microbatches` micro-batches.

    >>> build_schedule("1f1b", num_devices=2, num_microbatches=2).to_text().splitlines()[1:]
    ['0F0 0F1 0BW0 0BW1', '1F0 1BW0 1F1 1BW1']
    """
    info = get_generator(name)
    unknown = sorted(set(generator_kwargs) - set(info.options))
    if unknown:
        takes = ", ".join(info.options) if info.options else "no other options"
        raise ConfigError(f"schedule {name!r} does not take {', '.join(unknown)} (it takes {takes})")
    require_int(name, "num_devices", num_devices, 1)
    require_int(name, "num_microbatches", num_microbatches, 1)
    _check_size(name, num_devices, num_microbatches, generator_kwargs)
    return info.build(num_devices, num_microbatches, **generator_kwargs)


MAX_OPS = 2_000_000
"""Largest schedule built: beyond it a build and its simulation take minutes and gigabytes."""
_BYTES_PER_OP = 300
"""Python memory of one op through build, validation and simulation (measured order of magnitude)."""


def _check_size(name: str, p: int, m: int, kwargs: dict) -> None:
    """Refuse before building what would take minutes and gigabytes: F, B and W of every stage,
    micro-batch and slice, Chimera's and V-shapes' extra stages counted by the chunks."""
    chunks = kwargs.get("num_chunks") or 2  # most chunked and V schedules hold two stages a device
    slices = kwargs.get("num_slices") or 1
    if not all(isinstance(x, int) and x > 0 for x in (chunks, slices)):
        return  # the generator's own checks name the bad option
    ops = 3 * p * chunks * m * slices
    if ops > MAX_OPS:
        raise ConfigError(
            f"{name}: p={p} m={m} would make about {ops:,} ops (~{ops * _BYTES_PER_OP / 2**30:.1f} GiB to build and "
            f"simulate); pipeloom builds at most {MAX_OPS:,} — the bubble and memory of a pipeline repeat "
            "beyond a few times p micro-batches, so a smaller m tells the same"
        )


def require_int(schedule: str, what: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{schedule}: {what} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{schedule}: {what} must be at least {minimum}, got {value}")
    return value
