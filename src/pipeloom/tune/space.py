"""The tuner's search space: scheme × pp × dp × micro-batch size × chunks × slices × passes.

A `Candidate` is one point. Passes that trade time for memory (Mario, T-Recomp, T-Offload) are
tried only when the plain schedule does not fit (`Candidate.fallbacks`): each makes the step
longer, so a fitting schedule without them always wins. Static-memory measures (ZeRO-1/2, every
stage's optimizer offloaded: `pipeloom.static_memory`) are tried the same way, after those
passes fail at the level before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from pipeloom.errors import ConfigError
from pipeloom.schedules.registry import Tuning, list_generators

__all__ = ["Candidate", "DEFAULT_SCHEMES", "GENERATOR_OF", "SCHEMES", "candidates", "power_of_two_sizes"]


SCHEMES: dict[str, Tuning] = {info.tuning.scheme: info.tuning for info in list_generators() if info.tuning is not None}
"""The tuner's schemes, from the registry's descriptions (`schedules.registry.Tuning`)."""
GENERATOR_OF = {info.tuning.scheme: info.name for info in list_generators() if info.tuning is not None}
"""The generator that builds each scheme (the tuner's zb-v is v-auto under its budget)."""
DEFAULT_SCHEMES = tuple(name for name, tuning in SCHEMES.items() if tuning.default)
RUNNABLE_SCHEMES = tuple(SCHEMES)
"""What the runtime executes: every scheme (offload, slices and W parts included)."""


@dataclass(frozen=True)
class Candidate:
    scheme: str
    pp: int
    dp: int
    micro_batch: int
    num_microbatches: int
    chunks: int = 1
    slices: int = 1
    passes: tuple[str, ...] = ()
    zero: int = 0
    """ZeRO level of the static memory (0: none)."""

    @property
    def num_stages(self) -> int:
        return SCHEMES[self.scheme].num_stages(self.pp, self.chunks)

    @property
    def label(self) -> str:
        """E.g. ``1f1b pp=8 dp=4 mbs=2 +mario``."""
        parts = [self.scheme, f"pp={self.pp}", f"dp={self.dp}", f"mbs={self.micro_batch}"]
        if self.chunks > 1:
            parts.append(f"v={self.chunks}")
        if self.slices > 1:
            parts.append(f"s={self.slices}")
        if self.zero:
            parts.append(f"+zero{self.zero}")
        return " ".join(parts + [f"+{p}" for p in self.passes])

    @property
    def placement(self) -> list[list[int]]:
        """The stages each device hosts."""
        return SCHEMES[self.scheme].stages_on(self.pp, self.chunks)

    @property
    def replicas(self) -> int:
        """Copies of each stage in one pipeline: each sees 1/replicas of the micro-batches."""
        return SCHEMES[self.scheme].replicas

    def with_passes(self, passes: tuple[str, ...], zero: int | None = None) -> Candidate:
        return replace(self, passes=passes, zero=self.zero if zero is None else zero)


def power_of_two_sizes(largest: int) -> list[int]:
    """1, 2, 4, ... up to `largest`."""
    return [1 << k for k in range(largest.bit_length()) if 1 << k <= largest]


def candidates(
    devices: int,
    global_batch: int,
    *,
    tp: int = 1,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    pp_values: Sequence[int] | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    num_layers: int | None = None,
    rejected: list[tuple[str, str]] | None = None,
) -> Iterator[Candidate]:
    """Every point of the space that fits the device count and the batch; `rejected` receives
    (what, why) for the points ruled out on the way."""
    unknown = [name for name in schemes if name not in SCHEMES]
    if unknown:
        raise ConfigError(f"unknown scheme(s) {', '.join(unknown)}; choose among {', '.join(SCHEMES)}")
    if devices % tp:
        raise ConfigError(f"{devices} devices cannot be cut into tensor-parallel groups of {tp}")
    ranks = devices // tp
    pps = [pp for pp in (pp_values or range(1, ranks + 1)) if ranks % pp == 0]
    if not pps:
        raise ConfigError(f"no pipeline size among {list(pp_values or [])} divides {ranks} ranks")
    for pp in pps:
        dp = ranks // pp
        for mbs in micro_batches:
            if global_batch % (dp * mbs):
                if rejected is not None:
                    rejected.append(
                        (f"pp={pp} dp={dp} mbs={mbs}", f"global batch {global_batch} is not a multiple of dp × mbs")
                    )
                continue
            m = global_batch // (dp * mbs)
            for name in schemes:
                spec = SCHEMES[name]
                if pp < spec.min_devices or (spec.even and (pp % 2 or m % 2)):
                    continue
                if m < spec.fewest_microbatches(pp):
                    if rejected is not None:
                        rejected.append(
                            (f"{name} pp={pp} mbs={mbs}", f"{m} micro-batches; it needs {spec.fewest_microbatches(pp)}")
                        )
                    continue
                for v in spec.chunks:
                    if spec.whole_rounds and m > pp and m % pp:
                        continue
                    for s in spec.slices:
                        candidate = Candidate(name, pp, dp, mbs, m, v, s, spec.passes)
                        if num_layers is not None and candidate.num_stages > num_layers:
                            continue
                        yield candidate
