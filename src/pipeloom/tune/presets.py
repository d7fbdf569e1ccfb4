"""Model and hardware presets, and HF-style model configs, for the analytic cost model.

Model shapes are the papers' own (Mario Table 4 for GPT3-1.6B/13B and LLaMA2-3B/13B, Zero Bubble
Table 3 for its 1.5B–28.3B GPT-like models), GPT-3 175B from Brown et al., LLaMA-2 7B/34B/70B from
Meta's configs, with FlashAttention (no stored scores), as every engine trains them at 4K tokens
and beyond. Hardware figures are vendor peaks: dense 16-bit tensor FLOP/s, memory, HBM
bandwidth, NVLink (per direction) and the inter-node network per GPU; `efficiency` is the share of
peak a well-tuned transformer layer reaches (model FLOPs utilisation of the GEMMs).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from os import PathLike
from pathlib import Path
from typing import Any

from pipeloom.errors import ConfigError

__all__ = ["ModelSpec", "HardwareSpec", "MODEL_PRESETS", "HARDWARE_PRESETS", "load_model", "load_hardware"]


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only transformer, as its config names it."""

    name: str
    hidden: int
    layers: int
    heads: int
    ffn: int
    vocab: int = 50257
    seq_len: int = 1024
    kv_heads: int | None = None
    """Grouped-query attention: heads of K and V (None: as many as queries)."""
    gated: bool = False
    """SwiGLU feed-forward (three matrices, LLaMA) instead of two (GPT)."""
    flash_attention: bool = False
    """Attention scores are not stored (FlashAttention): drops Korthikanti's 5as/h term."""
    num_experts: int = 0
    """Mixture of experts: routed experts per layer (0: a dense MLP)."""
    num_experts_per_tok: int = 1
    """Experts each token is routed to (top-k)."""
    moe_ffn: int | None = None
    """One expert's intermediate size (None: ffn)."""
    expert_parallel: int = 1
    """GPUs the experts are spread over (EP): each holds num_experts / EP of them, and each token
    crosses an all-to-all to its experts and back, forward and backward."""
    router_loss: bool = False
    """The load-balancing loss over the routers' logits (HF `output_router_logits`): it needs
    whole micro-batches, so the runtime cuts no slices (SVPP) for it."""

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "ffn", "vocab", "seq_len"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {self.name!r}: {key} must be a positive integer, got {value!r}")
        if self.kv_heads is not None and (self.kv_heads < 1 or self.heads % self.kv_heads):
            raise ConfigError(f"model {self.name!r}: kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        for key in ("num_experts_per_tok", "expert_parallel"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"model {self.name!r}: {key} must be a positive integer, got {value!r}")
        if self.num_experts:
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"model {self.name!r}: num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})"
                )
            if self.num_experts % self.expert_parallel:
                raise ConfigError(
                    f"model {self.name!r}: expert_parallel ({self.expert_parallel}) must divide num_experts ({self.num_experts})"
                )

    @property
    def kv_hidden(self) -> int:
        return self.hidden * (self.kv_heads or self.heads) // self.heads

    @property
    def active_experts(self) -> int:
        """MLPs a token passes through: its top-k experts, or the one dense MLP."""
        return self.num_experts_per_tok if self.num_experts else 1

    @property
    def mlp_ffn(self) -> int:
        return (self.moe_ffn or self.ffn) if self.num_experts else self.ffn

    def linears(self) -> list[tuple[int, int]]:
        """(in, out) features of each weight matrix a token passes through in one layer (with
        experts: its top-k experts' MLPs)."""
        h, f = self.hidden, self.mlp_ffn
        attention = [(h, h + 2 * self.kv_hidden), (h, h)]
        mlp = [(h, 2 * f), (f, h)] if self.gated else [(h, f), (f, h)]
        return attention + mlp * self.active_experts

    @property
    def layer_params(self) -> int:
        """Weights a token's FLOPs run through in one layer."""
        return sum(i * o for i, o in self.linears())

    @property
    def stored_layer_params(self) -> int:
        """Weights one GPU holds of a layer: with experts, num_experts / EP of them."""
        if not self.num_experts:
            return self.layer_params
        return self._attention_params + self.stored_expert_params

    @property
    def stored_expert_params(self) -> int:
        """Of `stored_layer_params`, the routed experts' (0 for a dense layer)."""
        return self._expert_params * self.num_experts // self.expert_parallel if self.num_experts else 0

    @property
    def params(self) -> int:
        """Weights of the layers (every expert), the embedding and an untied head (norms, biases
        and routers left out)."""
        layer = (
            self._attention_params + self._expert_params * self.num_experts if self.num_experts else self.layer_params
        )
        return self.layers * layer + 2 * self.vocab * self.hidden

    @property
    def _attention_params(self) -> int:
        return sum(i * o for i, o in self.linears()[:2])

    @property
    def _expert_params(self) -> int:
        return (3 if self.gated else 2) * self.hidden * self.mlp_ffn

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: float
    """Dense 16-bit tensor FLOP/s."""
    memory: float
    """Device memory, bytes."""
    hbm_bandwidth: float
    """Bytes/s."""
    nvlink_bandwidth: float
    """Bytes/s per direction between GPUs of one node (PCIe where there is no NVLink)."""
    network_bandwidth: float
    """Bytes/s per GPU between nodes."""
    host_bandwidth: float = 25e9
    """Bytes/s each way between a GPU and its host (PCIe)."""
    host_flops: float = 2e11
    """FLOP/s of one GPU's share of the host CPUs (T-Offload's optimizer step)."""
    host_memory: float = float("inf")
    """Bytes of one GPU's share of its node's host memory: where offloaded optimizer state lives
    (infinite: not known, not checked)."""
    gpus_per_node: int = 8
    efficiency: float = 0.5
    """Share of peak_flops a transformer layer's GEMMs reach."""
    latency: float = 10e-6
    """Seconds per message, added to every transfer."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_GIB = 2**30


def _meta_llama2(name: str, hidden: int, layers: int, heads: int, ffn: int, kv_heads: int | None = None) -> ModelSpec:
    """A LLaMA-2 of Meta's config: its vocabulary, 4,096 positions, SwiGLU, FlashAttention."""
    return ModelSpec(
        name, hidden, layers, heads, ffn, vocab=32000, seq_len=4096, kv_heads=kv_heads, gated=True, flash_attention=True
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in [
        ModelSpec("gpt3-1.6b", hidden=1024, layers=128, heads=16, ffn=4096, seq_len=1024),
        ModelSpec("gpt3-13b", hidden=3000, layers=128, heads=40, ffn=12000, seq_len=1024),
        ModelSpec("gpt3-175b", hidden=12288, layers=96, heads=96, ffn=49152, seq_len=2048),
        ModelSpec("llama2-3b", hidden=2048, layers=64, heads=16, ffn=5504, vocab=32000, seq_len=1024, gated=True),
        _meta_llama2("llama2-7b", hidden=4096, layers=32, heads=32, ffn=11008),
        ModelSpec("llama2-13b", hidden=4096, layers=64, heads=32, ffn=11008, vocab=32000, seq_len=1024, gated=True),
        _meta_llama2("llama2-34b", hidden=8192, layers=48, heads=64, ffn=22016, kv_heads=8),
        _meta_llama2("llama2-70b", hidden=8192, layers=80, heads=64, ffn=28672, kv_heads=8),
        ModelSpec("zb-1.5b", hidden=2304, layers=22, heads=24, ffn=9216, seq_len=1024),
        ModelSpec("zb-6.2b", hidden=4096, layers=30, heads=32, ffn=16384, seq_len=1024),
        ModelSpec("zb-14.6b", hidden=5120, layers=46, heads=40, ffn=20480, seq_len=1024),
        ModelSpec("zb-28.3b", hidden=6144, layers=62, heads=48, ffn=24576, seq_len=1024),
    ]
}
"""Mario's LLaMA2-13B is its Table 4 shape (hidden 4096, 64 layers, sequence 1024)."""

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    spec.name: spec
    for spec in [
        HardwareSpec("a100-40g", 312e12, 40 * _GIB, 1.555e12, 300e9, 25e9, host_memory=1024 * _GIB / 8),
        HardwareSpec("a100-80g", 312e12, 80 * _GIB, 2.039e12, 300e9, 25e9, host_memory=2048 * _GIB / 8),
        HardwareSpec("h100", 989e12, 80 * _GIB, 3.35e12, 450e9, 50e9, host_bandwidth=50e9, host_memory=2048 * _GIB / 8),
        HardwareSpec("h200", 989e12, 141e9, 4.8e12, 450e9, 50e9, host_bandwidth=50e9, host_memory=2048 * _GIB / 8),
        HardwareSpec("rtx-4090", 165e12, 24 * _GIB, 1.008e12, 25e9, 12.5e9, efficiency=0.6, host_memory=64 * _GIB),
    ]
}
"""Host memory per GPU is the node's over its GPUs: a DGX A100 has 1 TiB (40 GB GPUs) or 2 TiB
(80 GB), a DGX H100 or H200 2 TiB, over 8 GPUs; an RTX 4090 server 512 GiB over 8."""


def load_model(name_or_path: str | PathLike[str]) -> ModelSpec:
    """A preset by name, or an HF-style config.json (hidden_size, num_hidden_layers, ...)."""
    key = str(name_or_path)
    if key.lower() in MODEL_PRESETS:
        return MODEL_PRESETS[key.lower()]
    path = Path(key)
    if not path.suffix == ".json":
        raise ConfigError(f"unknown model {key!r}: use a preset ({', '.join(MODEL_PRESETS)}) or a config .json file")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read model config {key!r}: {error}") from None
    return model_from_config(data, name=path.stem)


_HF_KEYS = {
    "hidden": ("hidden", "hidden_size", "n_embd", "d_model"),
    "layers": ("layers", "num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("heads", "num_attention_heads", "n_head"),
    "ffn": ("ffn", "intermediate_size", "n_inner", "ffn_hidden_size"),
    "vocab": ("vocab", "vocab_size"),
    "seq_len": ("seq_len", "max_position_embeddings", "n_positions", "seq_length"),
    "kv_heads": ("kv_heads", "num_key_value_heads"),
    "num_experts": ("num_experts", "num_local_experts", "n_routed_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "moe_topk"),
    "moe_ffn": ("moe_ffn", "moe_intermediate_size"),
    "expert_parallel": ("expert_parallel", "ep_size"),
    "router_loss": ("router_loss", "output_router_logits"),
}


def model_from_config(data: Any, name: str = "custom") -> ModelSpec:
    """ModelSpec from a dict with our keys or Hugging Face's (LLaMA-style configs are gated)."""
    if not isinstance(data, dict):
        raise ConfigError("a model config must be a JSON object")
    values: dict[str, Any] = {"name": data.get("name", name)}
    for key, aliases in _HF_KEYS.items():
        for alias in aliases:
            if data.get(alias) is not None:
                values[key] = data[alias]
                break
    missing = [key for key in ("hidden", "layers", "heads") if key not in values]
    if missing:
        raise ConfigError(
            f"model config {values['name']!r} lacks {', '.join(missing)} (HF: hidden_size, num_hidden_layers, num_attention_heads)"
        )
    values.setdefault("ffn", 4 * values["hidden"])
    activation = str(data.get("hidden_act", data.get("activation", ""))).lower()
    values["gated"] = bool(data.get("gated", activation in ("silu", "swiglu")))
    values["flash_attention"] = bool(data.get("flash_attention", False))
    known = {field.name for field in fields(ModelSpec)}
    return ModelSpec(**{key: value for key, value in values.items() if key in known})


def load_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name.lower()]
    except KeyError:
        raise ConfigError(f"unknown hardware {name!r}; presets: {', '.join(HARDWARE_PRESETS)}") from None
