"""The tuner's search space: scheme × pp × dp × micro-batch size × chunks × slices × passes.

A `Candidate` is one point. Passes that trade time for memory (Mario, T-Recomp, T-Offload) are
tried only when the plain schedule does not fit (`Candidate.fallbacks`): each makes the step
longer, so a fitting schedule without them always wins. Static-memory measures (ZeRO-1/2, every
stage's optimizer offloaded: `pipeloom.static_memory`) are tried the same way, after those
passes fail at the level before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

from pipeloom.errors import ConfigError

__all__ = ["Candidate", "SCHEMES", "DEFAULT_SCHEMES", "candidates", "power_of_two_sizes"]


@dataclass(frozen=True)
class SchemeSpec:
    generator: str
    chunks: tuple[int, ...] = (1,)
    slices: tuple[int, ...] = (1,)
    fallbacks: tuple[tuple[str, ...], ...] = (("mario",),)
    """Pass chains to try, in order, when the plain schedule is over the memory limit."""
    passes: tuple[str, ...] = ()
    """Passes always applied."""
    budgeted: bool = False
    """The generator takes the activation budget left after static memory (mem_limit)."""
    min_devices: int = 1
    even: bool = False
    """p and m must be even (Chimera)."""
    fewest_microbatches: Callable[[int], int] = lambda pp: 1
    """The least m the generator's steps need with pp devices (DualPipe's steady state)."""
    replicas: int = 1
    """Copies of each stage per pipeline (Chimera, DualPipe: 2)."""


SCHEMES: dict[str, SchemeSpec] = {
    "1f1b": SchemeSpec("1f1b"),
    "gpipe": SchemeSpec("gpipe"),
    "interleaved": SchemeSpec("interleaved", chunks=(2,), fallbacks=(("trecomp",), ("mario",))),
    "chimera": SchemeSpec("chimera", even=True, min_devices=2, replicas=2),
    "zb-h1": SchemeSpec("zb-h1"),
    "zb-auto": SchemeSpec("zb-auto", budgeted=True, fallbacks=()),
    "zb-v": SchemeSpec("v-auto", budgeted=True, fallbacks=(), min_devices=1),
    "tpipe": SchemeSpec(
        "tpipe", chunks=(2,), min_devices=2, fallbacks=(("trecomp",), ("trecomp", "offload"), ("mario",))
    ),
    "svpp": SchemeSpec("svpp", chunks=(1, 2), slices=(2, 4), passes=("wparts",), budgeted=True, fallbacks=()),
    # No memory fallbacks: Mario's recomputes would sit inside the overlapped pairs.
    "dualpipe": SchemeSpec(
        "dualpipe", even=True, min_devices=2, replicas=2, fallbacks=(), fewest_microbatches=lambda pp: 2 * pp - 2
    ),
    "dualpipev": SchemeSpec("dualpipev", fallbacks=(), fewest_microbatches=lambda pp: 2 * pp - 1),
}
NOT_TUNED: dict[str, str] = {
    "chimera-eager": "chimera's order with one more micro-batch in flight; compare it with `pipeloom compare`",
    "zb-1p": "zb-auto within p·M_B, which the tuner searches with its own budget",
    "zb-2p": "zb-auto within 2p·M_B, which the tuner searches with its own budget",
    "zb-h2": "zb-auto at (2p-1)·M_B finds it or better; `pareto` lists it",
    "zb-v": "the tuner's zb-v runs v-auto under the memory left after static memory (p·M_B or any other)",
    "v-half": "v-auto (the tuner's zb-v) within V-Half's budget; `pareto` lists it",
    "v-min": "v-auto (the tuner's zb-v) within V-Min's budget; `pareto` lists it",
    "terapipe": "svpp with every forward before the first backward is TeraPipe; svpp's search includes it",
}
"""Registered generators the tuner does not search, and why: every generator is either the
generator of a scheme in SCHEMES or named here (a test checks), so a new one cannot be missed."""
_V_SCHEMES = ("zb-v", "dualpipev")
DEFAULT_SCHEMES = (
    "1f1b", "interleaved", "chimera", "zb-h1", "zb-auto", "zb-v", "tpipe", "svpp", "dualpipe", "dualpipev",
)  # fmt: skip
RUNNABLE_SCHEMES = ("gpipe", *DEFAULT_SCHEMES)
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
        return 2 * self.pp if self.scheme in _V_SCHEMES else self.pp * self.chunks

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
        p, stages = self.pp, self.num_stages
        if self.scheme in _V_SCHEMES:
            return [[d, 2 * p - 1 - d] for d in range(p)]
        if SCHEMES[self.scheme].replicas == 2:  # down and up pipelines
            return [[d, p - 1 - d] for d in range(p)]
        return [list(range(d, stages, p)) for d in range(p)]

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
                    if name == "interleaved" and m > pp and m % pp:
                        continue
                    for s in spec.slices:
                        candidate = Candidate(name, pp, dp, mbs, m, v, s, spec.passes)
                        if num_layers is not None and candidate.num_stages > num_layers:
                            continue
                        yield candidate
