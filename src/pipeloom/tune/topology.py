"""Where each parallel dimension's groups sit on a cluster of nodes, and the link each one uses.

Ranks are numbered as Megatron-LM and torchtitan number them (and as `runtime.layout` does):
tensor parallelism innermost, then context parallelism, then the data-parallel replicas (expert
parallelism groups consecutive ones), then the pipeline. A group whose ranks are `stride` apart
spans `stride × size` consecutive ranks; it stays inside one node of `gpus_per_node` GPUs — on
NVLink — when that span fits in the node, and otherwise crosses the network, whose per-GPU
bandwidth every ring over it is held to. So the same tp = 8 is an NVLink group on 8-GPU nodes and
a network group on 4-GPU ones, and dp = 8 under tp = 1 is one node while under tp = 8 it is eight.
Torch-free: the tuner prices every collective by `Split.links`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pipeloom.errors import ConfigError
from pipeloom.tune.presets import ModelSpec

__all__ = ["Link", "Split", "splits", "model_splits", "divisors"]


@dataclass(frozen=True)
class Link:
    name: str
    """"NVLink" (inside a node) or "network" (between nodes)."""
    bandwidth: float
    """Bytes/s per GPU, per direction."""

    def describe(self) -> str:
        return f"{self.name} ({self.bandwidth / 1e9:g} GB/s)"


@dataclass(frozen=True)
class Split:
    """How each pipeline stage's ranks are cut: tp ranks share each layer's matrices, cp ranks
    each hold 1/cp of the sequence, and ep data-parallel (× cp) replicas share out the experts."""

    tp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def ranks(self) -> int:
        """Ranks of one pipeline device of one data-parallel replica."""
        return self.tp * self.cp

    @property
    def label(self) -> str:
        """E.g. ``tp=4 cp=2`` (empty for no split)."""
        return " ".join(f"{name}={value}" for name, value in self.sizes() if value > 1)

    def sizes(self) -> list[tuple[str, int]]:
        return [("tp", self.tp), ("cp", self.cp), ("ep", self.ep)]

    def links(self, dp: int, pp: int, gpus_per_node: int, intra: float, inter: float) -> dict[str, Link]:
        """Each dimension's link under this split with `dp` replicas and `pp` pipeline devices:
        "tp", "cp", "ep" and "dp" (the gradients' sum, over dp × cp ranks holding the same
        weights), and "pp" (the slowest stage boundary: the network once the pipeline leaves a node)."""
        tp, cp = self.tp, self.cp

        def link(stride: int, size: int) -> Link:
            """A group of `size` ranks, `stride` apart: inside a node when its span fits in one."""
            inside = size <= 1 or stride * size <= gpus_per_node
            return Link("NVLink", intra) if inside else Link("network", inter)

        return {
            "tp": link(1, tp),
            "cp": link(tp, cp),
            "ep": link(tp, self.ep),
            "dp": link(tp, cp * dp),
            "pp": link(tp * cp * dp, pp),  # stride: the ranks of one pipeline device
        }


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def splits(
    devices: int,
    *,
    heads: int,
    kv_heads: int,
    ffn: int | None,
    seq_len: int,
    num_experts: int = 0,
    gpus_per_node: int = 8,
    tp: Sequence[int] | None = None,
    cp: Sequence[int] | None = None,
    ep: Sequence[int] | None = None,
    vocab: int | None = None,
    name: str = "the model",
    min_cp_tokens: int = 1024,
) -> list[Split]:
    """The splits a search weighs: by default every tp that divides the node, the attention and
    K/V heads and the MLP columns (`ffn`; None for experts, which run whole on each tp rank);
    every cp that leaves each rank two equal chunks of at least `min_cp_tokens` / 2 tokens (the
    head-tail balance) — longer sequences, more of it; every ep up to the node that divides the
    experts (1 for a dense model). Given values are constraints: each is checked against the model, and one that
    cannot cut it is refused in one line; with `vocab`, tp must divide the vocabulary too (the
    runtime's vocabulary-parallel head). Only splits whose tp × cp divides `devices` are kept."""
    dense = ffn is not None

    def allowed(what: str, given: Sequence[int] | None, default: list[int], why) -> list[int]:
        if given is None:
            return [value for value in default if why(value) is None]
        for value in given:
            if value < 1:
                raise ConfigError(f"--{what} must be at least 1, got {value}")
            if (reason := why(value)) is not None:
                raise ConfigError(f"--{what} {value}: {reason}")
        return sorted(set(given))

    def tp_reason(value: int) -> str | None:
        counts = [(heads, "attention heads"), (kv_heads, "key/value heads")]
        counts += [(ffn, "MLP columns")] if dense and ffn else []
        counts += [(vocab, "vocabulary entries")] if vocab else []
        for count, what in counts:
            if count % value:
                return f"{name}'s {count} {what} do not divide by {value}"
        return None

    def cp_reason(value: int) -> str | None:
        if seq_len % (2 * value):
            return f"{name}'s sequence of {seq_len} tokens does not cut into {2 * value} equal chunks (two per rank)"
        return None

    def ep_reason(value: int) -> str | None:
        if value > 1 and not num_experts:
            return f"{name} has no routed experts to share out"
        if num_experts and num_experts % value:
            return f"{name}'s {num_experts} experts do not divide by {value}"
        return None

    tps = allowed("tp", tp, divisors(gpus_per_node), tp_reason)
    cps = allowed("cp", cp, [c for c in divisors(devices) if seq_len // c >= min_cp_tokens], cp_reason)
    eps = allowed("ep", ep, [e for e in divisors(num_experts or 1) if e <= gpus_per_node], ep_reason)
    out = [Split(t, c, e) for t in tps for c in cps for e in eps if devices % (t * c) == 0]
    if not out:
        raise ConfigError(
            f"no split of {devices} devices into tp × cp groups among tp {tps} and cp {cps}: "
            "each tp × cp must divide the devices"
        )
    return out


def model_splits(
    model: ModelSpec,
    devices: int,
    gpus_per_node: int,
    *,
    tp: Sequence[int] | None = None,
    cp: Sequence[int] | None = None,
    ep: Sequence[int] | None = None,
    whole_vocabulary: bool = False,
) -> list[Split]:
    """`splits` of `model` (its heads, MLP, sequence and experts); `whole_vocabulary`: tp must
    divide the vocabulary too (a plan the runtime runs: its vocabulary-parallel head)."""
    return splits(
        devices,
        heads=model.heads,
        kv_heads=model.kv_heads or model.heads,
        ffn=None if model.num_experts else model.ffn,
        seq_len=model.seq_len,
        num_experts=model.num_experts,
        gpus_per_node=gpus_per_node,
        tp=tp,
        cp=cp,
        ep=ep,
        vocab=model.vocab if whole_vocabulary else None,
        name=model.name,
    )
