"""A small LLaMA-style decoder cut into pipeline stages, and its synthetic data.

RMSNorm, rotary position embedding, SwiGLU and causal attention, as in LLaMA; sizes small enough
to train in seconds on two CPU cores. `build_stages` cuts the model into S stages — embedding on
the first, final norm and head on the last, decoder layers balanced or as given — each layer
initialised from its own seed (`stage_skeleton`), so that pipeline and reference start from
identical weights however the model is cut, and a rank makes only its own stages real.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.models.cut import counts_per_stage

__all__ = ["LlamaConfig", "build_stages", "llama_config", "synthetic_batch", "stage_layer_counts"]


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 128
    hidden: int = 64
    layers: int = 4
    heads: int = 4
    ffn: int = 128
    seq_len: int = 32
    microbatch_size: int = 2

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "heads", "ffn", "seq_len", "microbatch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"model: {name} must be a positive integer, got {value!r}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ConfigError(
                f"model: hidden ({self.hidden}) must split into {self.heads} heads of an even size (for rotary embedding)"
            )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(q: torch.Tensor, k: torch.Tensor, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate pairs of channels of the queries and keys by position-dependent angles (batch,
    heads, seq, head_dim; the angles computed once for both); positions start at `offset` (a
    slice's place in the sequence)."""
    seq, dim = q.shape[-2], q.shape[-1]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=q.device) / dim))
    positions = torch.arange(offset, offset + seq, dtype=torch.float32, device=q.device)
    angles = positions[:, None] * inv_freq[None, :]
    cos, sin = angles.cos().to(q.dtype), angles.sin().to(q.dtype)

    def rotated(x: torch.Tensor) -> torch.Tensor:
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)

    return rotated(q), rotated(k)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        h = config.hidden
        self.heads = config.heads
        self.attn_norm = RMSNorm(h)
        self.qkv = nn.Linear(h, 3 * h, bias=False)
        self.out = nn.Linear(h, h, bias=False)
        self.mlp_norm = RMSNorm(h)
        self.gate_up = nn.Linear(h, 2 * config.ffn, bias=False)
        self.down = nn.Linear(config.ffn, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_slice(x, None, None)[0]

    def forward_slice(
        self, x: torch.Tensor, past_k: torch.Tensor | None, past_v: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One causal slice of the sequence after `past_k`/`past_v` (the keys and values of the
        earlier slices, rotated): returns the output and this slice's rotated keys and values."""
        b, s, h = x.shape
        offset = 0 if past_k is None else past_k.shape[-2]
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        q, k = _rotary(q, k, offset)
        if past_k is None or past_v is None:
            attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            keys, values = torch.cat((past_k, k), dim=-2), torch.cat((past_v, v), dim=-2)
            visible = torch.ones(s, offset + s, dtype=torch.bool, device=x.device).tril(diagonal=offset)
            attention = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible)
        x = x + self.out(attention.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up), k, v


class Stage(nn.Module):
    """One pipeline stage: optional embedding, some decoder layers, optional norm and head."""

    def __init__(self, config: LlamaConfig, layers: int, first: bool, last: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.hidden) if first else None
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(layers))
        self.norm = RMSNorm(config.hidden) if last else None
        self.head = nn.Linear(config.hidden, config.vocab, bias=False) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_slice(x, [])[0]

    def split_at(self, count: int):
        """(head, tail): the embedding and the first `count` layers, then the other layers, norm and
        LM head — for a checkpoint of part of the stage (`--recompute-layers`)."""

        def head(x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x) if self.embed is not None else x
            for layer in self.layers[:count]:
                x = layer(x)
            return x

        def tail(x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[count:]:
                x = layer(x)
            return self.output(x)

        return head, tail

    def forward_slice(
        self, x: torch.Tensor, past: Sequence[tuple[torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """A slice of the sequence, given each layer's keys and values of the earlier slices
        (empty for the first slice): the output and each layer's keys and values of this slice."""
        if self.embed is not None:
            x = self.embed(x)
        kv = []
        for index, layer in enumerate(self.layers):
            past_k, past_v = past[index] if past else (None, None)
            x, k, v = cast(DecoderLayer, layer).forward_slice(x, past_k, past_v)
            kv.append((k, v))
        return self.output(x), kv

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """The last stage's norm and LM head; other stages hand `x` on as it is."""
        if self.norm is None or self.head is None:
            return x
        return self.head(self.norm(x))


def stage_layer_counts(config: LlamaConfig, num_stages: int, counts: Sequence[int] | None = None) -> list[int]:
    """Decoder layers per stage: as given, or balanced (the earlier stages take the remainder)."""
    fix = f"use at least {num_stages} layers (--layers) or fewer stages"
    return counts_per_stage(config.layers, num_stages, counts, "decoder layers", "model: ", fix)


def build_stages(config: LlamaConfig, num_stages: int, seed: int, counts: Sequence[int] | None = None) -> list[Stage]:
    """All S stages, initialised from `seed` identically wherever this runs, whatever the cut."""
    return stage_skeleton(config, num_stages, seed, counts).whole()


def stage_skeleton(config: LlamaConfig, num_stages: int, seed: int, counts: Sequence[int] | None = None):
    """The S stages on the meta device (`pipeloom.models.materialise`), initialised from `seed`
    layer by layer when made real: linears normal with std 1/√fan-in, the embedding N(0, 1),
    the norms' scales one."""
    from pipeloom.models.materialise import Skeleton
    from pipeloom.models.workload import global_names

    layer_counts = stage_layer_counts(config, num_stages, counts)
    with torch.device("meta"):
        stages = [Stage(config, layer_counts[s], first=s == 0, last=s == num_stages - 1) for s in range(num_stages)]
    return Skeleton(stages, _initialise, seed, global_names(stages))


def _initialise(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, std=1 / math.sqrt(module.in_features))
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight)
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)


def synthetic_batch(config: LlamaConfig, num_sequences: int, seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets for one step, the same on every rank."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + step)
    tokens = torch.randint(0, config.vocab, (num_sequences, config.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def llama_config(model, layers: int, micro_batch: int) -> LlamaConfig:
    """The built-in decoder of a planned model (`pipeloom.tune.presets.ModelSpec`) with `layers`."""
    return LlamaConfig(
        vocab=model.vocab,
        hidden=model.hidden,
        layers=layers,
        heads=model.heads,
        ffn=model.ffn,
        seq_len=model.seq_len,
        microbatch_size=micro_batch,
    )
