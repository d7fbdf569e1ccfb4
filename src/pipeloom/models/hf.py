"""Hugging Face `transformers` models cut into pipeline stages (`--model hf:PATH`).

The model is the library's own code: built from the directory's config.json under a fixed seed,
or loaded from its local safetensors files when it has them (never from a hub). It is cut by the
plan's layer counts — embeddings on the first stage, decoder layers in order, final norm and
head on the last — and each stage calls the library's layers directly:

* LLaMA, Mistral, Qwen2 (rotary: each stage computes the position embeddings of its positions
  from the model's own rotary module), GPT-2 (learned positions, Conv1D projections);
* BERT as a masked LM (bidirectional, so no slices), Mamba through its pure-torch path.

Tied input and output embeddings stay one parameter object in the model, so the runtime finds the tie by
identity and sums its gradients over the ranks holding the two ends. Dropout is set to zero: a pipeline (and a
recompute) draws random numbers in another order than one process, so with dropout no schedule could equal
single-process training. Causal LMs also run slice by slice (MEPipe, TeraPipe): a slice's layers read the keys
and values of the earlier slices through a `DynamicCache` seeded with them, under an explicit causal mask.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.models.compat import import_transformers
from pipeloom.models.context_parallel import ContextShard, KeyValueGather
from pipeloom.models.cut import counts_per_stage
from pipeloom.models.hf_moe import RouterLogits
from pipeloom.models.memory_guard import check_trainable_here, hf_parameter_count

__all__ = ["FAMILIES", "load_hf_config", "hf_workload", "HFStage", "has_weights"]

ROTARY = ("llama", "mistral", "qwen2")
MIXTURES = ("mixtral", "qwen2_moe", "qwen3_moe")
"""Mixture-of-experts families: LLaMA-like layers whose MLP is the library's sparse MoE block."""
CAUSAL = (*ROTARY, *MIXTURES, "gpt2", "mamba")
FAMILIES = (*CAUSAL, "bert")


def _config_path(path: str | Path) -> Path:
    path = Path(path)
    config = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise ConfigError(f"hf: {str(path)!r} does not exist (give a model directory or its config.json)")
    if not config.is_file():
        raise ConfigError(f"hf: {str(path)!r} has no config.json")
    return config


def load_hf_config(path: str | Path, layers: int | None = None):
    """The transformers config of a directory or config.json, checked to be a family we cut."""
    config_file = _config_path(path)
    try:
        data = json.loads(config_file.read_text())
    except (OSError, ValueError) as error:
        raise ConfigError(f"hf: cannot read {str(config_file)!r}: {error}") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ConfigError(f"hf: {str(config_file)!r} is not a transformers config (no model_type)")
    family = data["model_type"]
    if family not in FAMILIES:
        raise ConfigError(f"hf: model type {family!r} is not supported; supported: {', '.join(FAMILIES)}")
    transformers = import_transformers()
    from huggingface_hub.errors import StrictDataclassError  # transformers' own dependency

    try:
        config = transformers.AutoConfig.for_model(**data)
    except (ValueError, TypeError, KeyError, StrictDataclassError) as error:  # the last: the library's own checks
        reason = error.__cause__ if isinstance(error, StrictDataclassError) and error.__cause__ else error
        raise ConfigError(f"hf: {str(config_file)!r} is malformed: {reason}") from None
    _check_heads(config, config_file)
    for key, value in list(config.to_dict().items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    if layers is not None:
        _with_layers(config, layers)
    return config


def _with_layers(config, layers: int) -> None:
    """`config` cut to its first `layers` layers (a probe's stage), or its pattern repeated past
    them: where it lists each layer's kind (Qwen2's `layer_types`: full or sliding attention) the
    list must stay one entry a layer, or the library refuses the config."""
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, list) and kinds:
        config.layer_types = [kinds[i % len(kinds)] for i in range(layers)]
    config.num_hidden_layers = layers


def _check_heads(config, config_file: Path) -> None:
    """Attention that transformers can build: a hidden size that splits into the heads, and query
    heads in whole groups per key/value head (a Mixtral config with 4 heads takes its default 8
    K/V heads, and failed deep in the first forward)."""
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    hidden = getattr(config, "hidden_size", None)
    if not (isinstance(heads, int) and isinstance(kv_heads, int) and isinstance(hidden, int)):
        return
    if heads < 1 or kv_heads < 1 or heads % kv_heads:
        raise ConfigError(
            f"hf: {str(config_file)!r}: {heads} attention heads do not group over {kv_heads} key/value heads "
            "(num_attention_heads must be a multiple of num_key_value_heads)"
        )
    if hidden % heads and getattr(config, "head_dim", None) is None:
        raise ConfigError(f"hf: {str(config_file)!r}: hidden size {hidden} does not split into {heads} heads")


def has_weights(path: str | Path) -> bool:
    path = Path(path)
    return path.is_dir() and any(path.glob("*.safetensors"))


def _meta_model(config) -> nn.Module:
    """The transformers model of `config` on the meta device (shapes only), in training mode."""
    transformers = import_transformers()
    auto = transformers.AutoModelForMaskedLM if config.model_type == "bert" else transformers.AutoModelForCausalLM
    options = {} if config.model_type == "mamba" else {"attn_implementation": "sdpa"}
    if config.model_type in MIXTURES:  # the library's dense expert loop: any dtype, and FLOP-countable
        options["experts_implementation"] = "eager"
    with torch.device("meta"):
        model = auto.from_config(config, dtype=torch.float32, **options)
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
    return model.train()


def _parts(model: Any, family: str) -> dict:
    """The library's modules by role: embed, (positions), layers, norm, head, (rotary). `model`
    is a transformers model of `family`, whose attribute names differ by family."""
    if family in ROTARY + MIXTURES:
        inner = model.model
        return {
            "embed": inner.embed_tokens,
            "layers": inner.layers,
            "norm": inner.norm,
            "head": model.lm_head,
            "rotary": inner.rotary_emb,
        }
    if family == "gpt2":
        inner = model.transformer
        return {
            "embed": inner.wte,
            "positions": inner.wpe,
            "layers": inner.h,
            "norm": inner.ln_f,
            "head": model.lm_head,
        }
    if family == "mamba":
        inner = model.backbone
        return {"embed": inner.embeddings, "layers": inner.layers, "norm": inner.norm_f, "head": model.lm_head}
    return {"embed": model.bert.embeddings, "layers": model.bert.encoder.layer, "head": model.cls}


class HFStage(nn.Module):
    """One stage of a transformers model: optional embeddings, some of its layers, optional
    final norm and head — the library's modules, shared with (not copied from) the model."""

    def __init__(
        self,
        parts: dict,
        family: str,
        layers: Sequence[nn.Module],
        first: bool,
        last: bool,
        routers: RouterLogits | None = None,
    ) -> None:
        super().__init__()
        self.routers = routers
        """A MoE model's router logits, handed on for the load-balancing loss (`hf_moe`); None:
        the stage hands on its hidden states only."""
        self.family = family
        self.embed = parts["embed"] if first else None
        self.positions = parts.get("positions") if first else None
        self.layers = nn.ModuleList(layers)
        self.norm = parts.get("norm") if last else None
        self.head = parts["head"] if last else None
        self.rotary = parts.get("rotary") if layers else None
        self.model_names: dict[str, str] = {}
        """Each parameter's name in the transformers model (`workload.global_names`)."""
        self.sequence_shard = (0, 1)
        """(index, count): under sequence parallelism the hidden states this stage sees are shard
        `index` of `count` along the sequence (positions follow the whole sequence)."""
        self.context: ContextShard | None = None
        """Under context parallelism, this rank's share of every sequence (`models.context_parallel`):
        its tokens' true positions, and the keys and values gathered over its group."""

    def forward(self, x: torch.Tensor, *carried: torch.Tensor):
        return self._run(x, None, carried=carried)[0]

    def forward_slice(self, x: torch.Tensor, past: Sequence[tuple[torch.Tensor, torch.Tensor]]):
        """A causal slice after the earlier slices' keys and values (per layer): the output and
        this slice's keys and values per layer."""
        if self.family not in (*ROTARY, *MIXTURES, "gpt2"):
            raise ConfigError(f"hf: {self.family} models do not run slice by slice (attention-free or bidirectional)")
        if self.routers is not None:
            raise ConfigError(
                "hf: the load-balancing loss needs whole micro-batches; no slices with output_router_logits"
            )
        return self._run(x, list(past))

    def split_at(self, count: int):
        """(head, tail): the embeddings and the first `count` layers, then the rest — for a
        checkpoint of part of the stage (`--recompute-layers`); unsliced only."""
        count = min(count, len(self.layers))
        return (
            (lambda x, *carried: self._run(x, None, stop=count, carried=carried)[0]),
            (lambda x, *carried: self._run(x, None, start=count, carried=carried)[0]),
        )

    def _run(self, x: torch.Tensor, past: list | None, start: int = 0, stop: int | None = None, carried=()):
        offset = past[0][0].shape[-2] if past else 0
        index, count = self.sequence_shard
        embed = self.embed if start == 0 else None
        seq = x.shape[1] * (1 if embed is not None else count)  # token ids are whole; hidden states may be a shard
        if self.context is not None:  # this rank's tokens, wherever they sit in the sequence
            positions = self.context.positions(x.device).unsqueeze(0)
        else:
            positions = torch.arange(offset, offset + seq, device=x.device).unsqueeze(0)
        if embed is not None:
            x = embed(x)
            if self.positions is not None:
                x = x + self.positions(positions.chunk(count, dim=1)[index])
        cache: Any = None
        mask = None
        if self.context is not None:  # every key and value of the sequence, masked by true position
            cache, mask = KeyValueGather(self.context), self.context.causal_mask(x.device)
        if past is not None:
            cache = import_transformers().DynamicCache()
            for layer, (k, v) in zip(self.layers, past):
                cache.update(k, v, _layer_index(layer))
            if offset:  # the slice sees every earlier position and itself causally
                mask = torch.ones(seq, offset + seq, dtype=torch.bool, device=x.device).tril(offset)[None, None]
        extra = {}
        if self.rotary is not None and self.layers:
            extra["position_embeddings"] = self.rotary(x, positions)
        if self.routers is not None:
            self.routers.begin()
        for layer in self.layers[start:stop]:
            x = self._layer(layer, x, mask, positions, cache, extra)
        if stop is not None:  # a head: the norm and the LM head belong to the tail
            return (self.routers.handed_on(x, carried) if self.routers is not None else x), []
        if self.norm is not None:
            x = self.norm(x)
        if self.head is not None:
            x = self.head(x)
        if self.routers is not None:
            return self.routers.handed_on(x, carried), []
        kv = []
        if past is not None:
            for layer in self.layers:
                entry = cache.layers[_layer_index(layer)]
                kv.append((entry.keys[..., offset:, :], entry.values[..., offset:, :]))
        return x, kv

    def _layer(self, layer, x, mask, positions, cache, extra):
        if self.family == "gpt2":
            return _tensor(layer(x, cache, mask, position_ids=positions))
        if self.family == "mamba":
            return _tensor(layer(x))
        if self.family == "bert":
            return _tensor(layer(x))
        return _tensor(layer(x, attention_mask=mask, position_ids=positions, past_key_values=cache, **extra))


def _tensor(out) -> torch.Tensor:
    return out[0] if isinstance(out, tuple) else out


def _layer_index(layer: nn.Module) -> int:
    attention = getattr(layer, "self_attn", None) or getattr(layer, "attn", None)
    if attention is None:
        raise ConfigError(f"{type(layer).__name__} has no attention module to read its layer index from")
    return attention.layer_idx


def layer_counts_for(num_layers: int, num_stages: int, counts: Sequence[int] | None) -> list[int]:
    return counts_per_stage(num_layers, num_stages, counts, "layers", "hf: ")


def hf_model(path, config, seed: int) -> nn.Module:
    """The whole transformers model with the weights pipeloom's stages start from."""
    model = _meta_model(config)
    _skeleton_of(model, path, config, seed, 1, None).whole()
    return model


def hf_skeleton(path, config, seed: int, num_stages: int, counts: Sequence[int] | None = None):
    """The model's stages on the meta device (`pipeloom.models.materialise`): values from the
    directory's weights when it has them, else the library's initialisation from `seed`."""
    return _skeleton_of(_meta_model(config), path, config, seed, num_stages, counts)


def _skeleton_of(model: nn.Module, path, config, seed: int, num_stages: int, counts: Sequence[int] | None):
    from pipeloom.models.materialise import Skeleton

    family = config.model_type
    parts = _parts(model, family)
    sizes = layer_counts_for(len(parts["layers"]), num_stages, counts)
    routed = family in MIXTURES and getattr(config, "output_router_logits", False)
    model_names = {id(p): name for name, p in model.named_parameters()}  # a tied weight: its first name
    stages, first = [], 0
    for s, size in enumerate(sizes):
        layers = list(parts["layers"][first : first + size])
        routers = RouterLogits(config, layers) if routed else None
        stage = HFStage(parts, family, layers, first=s == 0, last=s == num_stages - 1, routers=routers)
        stage.model_names = {name: model_names[id(p)] for name, p in stage.named_parameters()}
        stages.append(stage)
        first += size
    names = [stage.model_names for stage in stages]
    weights = None
    if has_weights(path):
        from pipeloom.models.hf_weights import weights_of

        options = {"experts_implementation": "eager"} if config.model_type in MIXTURES else {}
        weights = weights_of(path, config, set(model_names.values()), config.model_type, options)
    return Skeleton(stages, cast(Callable[[nn.Module], None], model._init_weights), seed, names, weights)


def build_hf_stages(path, config, seed: int, num_stages: int, counts: Sequence[int] | None = None) -> list[HFStage]:
    return hf_skeleton(path, config, seed, num_stages, counts).whole()


def hf_workload(
    path: str | Path,
    seed: int = 0,
    microbatch_size: int = 1,
    seq_len: int = 64,
    layer_counts: Sequence[int] | None = None,
    data=None,
    layers: int | None = None,
):
    """The Workload of a transformers model directory: causal LMs learn the next token, BERT the
    masked ones; `data` (a `pipeloom.data` source) replaces synthetic tokens."""
    from pipeloom.data import SyntheticTokens, masked_lm
    from pipeloom.models.hf_moe import expert_plan, router_loss
    from pipeloom.models.hf_tp import tensor_parallel_plan
    from pipeloom.models.workload import Workload, token_loss

    config = load_hf_config(path, layers)
    family = config.model_type
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if seq_len < 1 or microbatch_size < 1:
        raise ConfigError(
            f"hf: sequence length and micro-batch size must be at least 1, got {seq_len} and {microbatch_size}"
        )
    if limit is not None and seq_len > limit:
        raise ConfigError(f"hf: sequence length {seq_len} exceeds the model's {limit} positions; lower --seq-len")
    window = getattr(config, "sliding_window", None)
    windowed = family in ("mistral", "mixtral") or getattr(config, "use_sliding_window", False)
    if windowed and window is not None and seq_len > window:
        raise ConfigError(f"hf: sequence length {seq_len} exceeds the model's sliding window {window}; lower --seq-len")
    check_trainable_here(hf_parameter_count(config), what=f"hf:{family} ({path})")
    source = data if data is not None else SyntheticTokens(config.vocab_size, seq_len, seed)
    if source.vocab_limit is not None and source.vocab_limit > config.vocab_size:
        raise ConfigError(
            f"data: token ids reach {source.vocab_limit - 1}, beyond the model's vocabulary of {config.vocab_size}"
        )
    prepare = (lambda tokens: masked_lm(tokens, config.vocab_size, seed)) if family == "bert" else None
    routed = getattr(config, "output_router_logits", False)
    return Workload(
        build=lambda num_stages: build_hf_stages(path, config, seed, num_stages, layer_counts),
        skeleton=lambda num_stages: hf_skeleton(path, config, seed, num_stages, layer_counts),
        batch=prepare(source) if prepare is not None else source.batch,
        loss=router_loss(config, token_loss) if family in MIXTURES else token_loss,
        microbatch_size=microbatch_size,
        sample_tokens=seq_len,
        name=f"hf:{family}",
        experts=expert_plan(config) if family in MIXTURES else None,
        check=lambda num_stages: layer_counts_for(config.num_hidden_layers, num_stages, layer_counts),
        tensor_parallel=lambda tp, sequence: tensor_parallel_plan(config, tp, sequence),
        vocab=config.vocab_size,
        prepare=prepare,
        description={"kind": "hf", "family": family, "config": config.to_dict(), "source": str(path)},
        data=source.provenance,
        # the load-balancing loss weighs every token's routing: not a sum of the cp ranks' shares
        context_parallel=_on_context if family in ROTARY or (family in MIXTURES and not routed) else None,
    )


def _on_context(stage: nn.Module, shard: ContextShard) -> None:
    """The stage runs on `shard` of every sequence (rotary families: positions are the tokens')."""
    assert isinstance(stage, HFStage), "an HF workload's stages are HFStages"
    stage.context = shard
