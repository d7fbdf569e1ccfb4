"""The tuner's search space: split (tp, cp, ep) × scheme × pp × dp × micro-batch size × chunks ×
slices × passes.

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
from pipeloom.tune.topology import Split

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
    split: Split = Split()
    """How each stage's ranks are cut: tensor, context and expert parallelism."""

    @property
    def devices(self) -> int:
        return self.pp * self.dp * self.split.ranks

    @property
    def num_stages(self) -> int:
        return SCHEMES[self.scheme].num_stages(self.pp, self.chunks)

    @property
    def label(self) -> str:
        """E.g. ``1f1b pp=8 dp=4 mbs=2 +mario``, ``zb-v pp=4 dp=2 tp=4 cp=2 mbs=1``."""
        parts = [self.scheme, f"pp={self.pp}", f"dp={self.dp}"]
        parts += [self.split.label] if self.split.label else []
        parts.append(f"mbs={self.micro_batch}")
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
    splits: Sequence[Split] | None = None,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    pp_values: Sequence[int] | None = None,
    micro_batches: Sequence[int] = (1, 2, 4, 8, 16, 32),
    num_layers: int | None = None,
    rejected: list[tuple[str, str]] | None = None,
) -> Iterator[Candidate]:
    """Every point of the space that fits the device count and the batch, for each of `splits`
    (default: tp alone); `rejected` receives (what, why) for the points ruled out on the way.
    Expert parallelism borrows from the data-parallel replicas, so dp must be a multiple of ep;
    slices and context parallelism both cut the sequence, so a split with cp > 1 takes none."""
    unknown = [name for name in schemes if name not in SCHEMES]
    for info in list_generators():  # a schedule `list` knows, which the tuner reaches another way or not at all
        if info.name in unknown and info.tuning is not None:
            raise ConfigError(f"tune searches {info.name} as {info.tuning.scheme}: pass --schemes {info.tuning.scheme}")
        if info.name in unknown:
            raise ConfigError(
                f"tune does not search {info.name} as a scheme ({info.not_tuned}); choose among {', '.join(SCHEMES)}"
            )
    if unknown:
        raise ConfigError(f"unknown scheme(s) {', '.join(unknown)}; choose among {', '.join(SCHEMES)}")
    every = list(splits) if splits is not None else [Split(tp)]
    for split in every:
        if devices % split.ranks:
            what = "tensor-parallel groups" if split.cp == 1 else "tp × cp groups"
            raise ConfigError(f"{devices} devices cannot be cut into {what} of {split.ranks}")
    if pp_values and not any((devices // split.ranks) % pp == 0 for split in every for pp in pp_values):
        raise ConfigError(f"no pipeline size among {list(pp_values)} divides {devices // every[0].ranks} ranks")
    for split in every:
        yield from _points(
            devices // split.ranks, split, global_batch, schemes, pp_values, micro_batches, num_layers, rejected
        )


def _points(
    ranks: int,
    split: Split,
    global_batch: int,
    schemes: Sequence[str],
    pp_values: Sequence[int] | None,
    micro_batches: Sequence[int],
    num_layers: int | None,
    rejected: list[tuple[str, str]] | None,
) -> Iterator[Candidate]:
    for pp in (pp for pp in (pp_values or range(1, ranks + 1)) if ranks % pp == 0):
        dp = ranks // pp
        if dp % split.ep:
            continue
        for mbs in micro_batches:
            if global_batch % (dp * mbs):
                if rejected is not None:
                    rejected.append(
                        (
                            f"pp={pp} dp={dp} {split.label} mbs={mbs}".replace("  ", " "),
                            f"global batch {global_batch} is not a multiple of dp × mbs",
                        )
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
                        if s > 1 and split.cp > 1:  # both cut the sequence: the runtime runs one or the other
                            continue
                        candidate = Candidate(name, pp, dp, mbs, m, v, s, spec.passes, split=split)
                        if num_layers is not None and candidate.num_stages > num_layers:
                            continue
                        yield candidate
