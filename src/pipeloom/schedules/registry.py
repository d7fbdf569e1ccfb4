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
    return info.build(num_devices, num_microbatches, **generator_kwargs)


def require_int(schedule: str, what: str, value: Any, minimum: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{schedule}: {what} must be an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{schedule}: {what} must be at least {minimum}, got {value}")
    return value
