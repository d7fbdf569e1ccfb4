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

__all__ = ["GeneratorInfo", "Tuning", "register", "build_schedule", "get_generator", "list_generators", "require_int"]


def _any_count(pp: int) -> int:
    return 1


@dataclass(frozen=True, slots=True)
class Tuning:
    """How the tuner searches a generator: the one description `tune` (its space, its builds),
    `pareto` and the docs read. A generator without one says why (`not_tuned`)."""

    scheme: str
    """The tuner's name for it (`--schemes`): the generator's own, or the scheme it implements."""
    layout: str = "chunked"
    """Where stages sit: "chunked" (stage s on device s mod p, v chunks a device), "v" (s and
    2p-1-s on one device) or "mirrored" (two pipelines in opposite directions: every stage twice)."""
    chunks: tuple[int, ...] = (1,)
    slices: tuple[int, ...] = (1,)
    fallbacks: tuple[tuple[str, ...], ...] = (("mario",),)
    """Pass chains to try, in order, when the plain schedule is over the memory limit."""
    passes: tuple[str, ...] = ()
    """Passes always applied."""
    budgeted: bool = False
    """The generator fits itself to the activation budget left after static memory."""
    table3_forwards: bool = False
    """Built with Table 3's forwards before the first backward (one build) instead of searching
    them within the budget (SVPP: the search would build many schedules per candidate)."""
    min_devices: int = 1
    even: bool = False
    """p and m must be even (two pipelines share the devices)."""
    whole_rounds: bool = False
    """m at most p or a multiple of p (the interleaved schedule's domain)."""
    fewest_microbatches: Callable[[int], int] = _any_count
    """The least m the generator's steps need with pp devices (DualPipe's steady state)."""
    default: bool = True
    """Searched when `tune` is given no --schemes."""

    @property
    def replicas(self) -> int:
        """Copies of each stage in one pipeline (each sees 1/replicas of the micro-batches)."""
        return 2 if self.layout == "mirrored" else 1

    def num_stages(self, p: int, chunks: int = 1) -> int:
        return 2 * p if self.layout == "v" else p * chunks

    def stages_on(self, p: int, chunks: int = 1) -> list[list[int]]:
        """The stages each of `p` devices hosts."""
        if self.layout == "v":
            return [[d, 2 * p - 1 - d] for d in range(p)]
        if self.layout == "mirrored":  # down and up pipelines
            return [[d, p - 1 - d] for d in range(p)]
        return [list(range(d, p * chunks, p)) for d in range(p)]

    def device_of_stage(self, p: int, chunks: int = 1) -> list[int]:
        """The device of each stage (one pipeline's copy)."""
        devices = [0] * self.num_stages(p, chunks)
        for d, stages in enumerate(self.stages_on(p, chunks)):
            for s in stages:
                devices[s] = d
        return devices


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
    tuning: Tuning | None = None
    """How the tuner searches it; None: `not_tuned` says why not."""
    not_tuned: str = ""
    pareto: str | None = None
    """How `pareto` shows it: "fixed" (one schedule), "budgeted" (swept over budgets) or None."""


_GENERATORS: dict[str, GeneratorInfo] = {}


def register(
    name: str,
    *,
    family: str,
    paper: str,
    summary: str,
    domain: str,
    options: tuple[str, ...] = (),
    tuning: Tuning | None = None,
    not_tuned: str = "",
    pareto: str | None = None,
) -> Callable[[Callable[..., Schedule]], Callable[..., Schedule]]:
    """Register a generator with what the tuner needs of it: a `tuning`, or in `not_tuned` the
    reason the tuner leaves it out — one or the other, so no generator is missed silently."""
    if (tuning is None) == (not not_tuned):
        raise RuntimeError(f"schedule generator {name!r}: give tuning= or not_tuned='why', exactly one")
    if pareto not in (None, "fixed", "budgeted"):
        raise RuntimeError(f"schedule generator {name!r}: pareto must be 'fixed', 'budgeted' or None")

    def decorate(build: Callable[..., Schedule]) -> Callable[..., Schedule]:
        if name in _GENERATORS:
            raise RuntimeError(f"schedule generator {name!r} registered twice")
        _GENERATORS[name] = GeneratorInfo(
            name, build, family, paper, summary, domain, options, tuning, not_tuned, pareto
        )
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
