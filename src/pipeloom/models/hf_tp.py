"""How each transformers family's stages split over a tensor-parallel group: the plans
(`pipeloom.models.workload.TensorParallelPlan`) the runtime's styles apply — the dense families
from the library's own `base_model_tp_plan` or written here in the same Megatron layout, the
mixtures of experts with their attention split and their MoE block whole on every rank."""

from __future__ import annotations

from torch import nn

from pipeloom.errors import ConfigError
from pipeloom.models.hf import MIXTURES, HFStage

__all__ = ["tensor_parallel_plan"]


def tensor_parallel_plan(config, tp: int, sequence_parallel: bool):
    """How a family's stages split over `tp` ranks (`pipeloom.models.workload.TensorParallelPlan`):
    LLaMA, Mistral and Qwen2 from transformers' own `base_model_tp_plan` (which linears are column-
    and row-parallel), plus where the region starts (attention and MLP inputs) and the vocabulary
    ends; GPT-2 (fused q/k/v in one Conv1D) and BERT, which have no plan, in the same Megatron
    layout written here."""
    from pipeloom.models.workload import TensorParallelPlan

    family = config.model_type
    if family == "mamba":
        raise ConfigError("hf: Mamba has no tensor-parallel plan (its mixer is not split into heads); use --tp 1")
    if family in MIXTURES:
        return _mixture_plan(config, tp, sequence_parallel)
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    inner = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * config.hidden_size
    for what, count in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("MLP columns", inner),
        ("vocabulary entries", config.vocab_size),
    ):
        if count % tp:
            raise ConfigError(f"hf: the model's {count} {what} do not divide by --tp {tp}")
    if family in ("llama", "mistral", "qwen2"):
        base = dict(getattr(config, "base_model_tp_plan", None) or {})
        unknown = sorted({role for role in base.values() if role not in ("colwise", "rowwise")})
        if unknown:
            raise ConfigError(
                f"hf: {family}'s tensor-parallel plan uses {', '.join(unknown)}, which pipeloom does not run"
            )
        blocks = {"layers.*.self_attn": "region_input", "layers.*.mlp": "region_input"}
        modules = {**blocks, **base, "embed": "vocab_embedding", "head": "vocab_head"}
        return TensorParallelPlan(modules, adjust=_shard_positions)
    if family == "gpt2":

        def fused_split(stage: nn.Module, size: int, index: int, sequence: bool) -> None:
            for layer in getattr(stage, "layers", ()):
                layer.attn.split_size = layer.attn.embed_dim // size
            _shard_positions(stage, size, index, sequence)

        modules = {
            "layers.*.attn": "region_input",
            "layers.*.mlp": "region_input",
            "layers.*.attn.c_attn": "packed_colwise3",
            "layers.*.attn.c_proj": "rowwise",
            "layers.*.mlp.c_fc": "colwise",
            "layers.*.mlp.c_proj": "rowwise",
            "embed": "vocab_embedding",
            "head": "vocab_head",
        }
        return TensorParallelPlan(modules, adjust=fused_split)
    modules = {  # BERT: the embeddings' positions and norm run on the whole sequence, then it is cut
        "layers.*.attention.self": "region_input",
        "layers.*.intermediate": "region_input",
        "layers.*.attention.self.query": "colwise",
        "layers.*.attention.self.key": "colwise",
        "layers.*.attention.self.value": "colwise",
        "layers.*.attention.output.dense": "rowwise",
        "layers.*.intermediate.dense": "colwise",
        "layers.*.output.dense": "rowwise",
        "embed.word_embeddings": "vocab_embedding_replicated",
        "head.predictions.decoder": "vocab_head",
    }
    if sequence_parallel:
        modules["embed"] = "scatter_after"
    return TensorParallelPlan(modules, full_sequence=("embed",), adjust=_shard_positions)


def _shard_positions(stage: nn.Module, size: int, index: int, sequence: bool) -> None:
    """The stage's hidden states are sequence shard `index` of `size` (under sequence parallelism)."""
    if isinstance(stage, HFStage):
        stage.sequence_shard = (index, size) if sequence else (0, 1)


def _mixture_plan(config, tp: int, sequence_parallel: bool):
    """A mixture of experts under `tp`: attention split as the dense families' (the library's
    plan, its attention entries), the vocabulary split; the MoE block — router and experts — runs
    whole on every rank of the group, on the hidden states the attention's region leaves
    replicated, so its outputs and gradients are the same on every rank (`--ep` shares the
    experts out over data-parallel replicas instead). Not under sequence parallelism, where each
    rank's block would see a shard of the tokens and the load-balancing loss all of them."""
    from pipeloom.models.workload import TensorParallelPlan

    family = config.model_type
    if sequence_parallel:
        raise ConfigError(
            f"hf: {family} runs its experts whole on every tensor-parallel rank, which needs every token there; "
            "drop --sequence-parallel"
        )
    heads, kv_heads = (
        config.num_attention_heads,
        getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
    )
    for what, count in (
        ("attention heads", heads),
        ("key/value heads", kv_heads),
        ("vocabulary entries", config.vocab_size),
    ):
        if count % tp:
            raise ConfigError(f"hf: the model's {count} {what} do not divide by --tp {tp}")
    base: dict[str, str] = dict(getattr(config, "base_model_tp_plan", None) or {})
    library: dict[str, str] = {"replicated_with_grad_allreduce": "replicated_summed"}  # Qwen3's per-head q/k norms
    attention = {name: library.get(role, role) for name, role in base.items() if ".self_attn." in name}
    unknown = sorted({role for role in attention.values() if role not in ("colwise", "rowwise", "replicated_summed")})
    if unknown:
        raise ConfigError(f"hf: {family}'s attention plan uses {', '.join(unknown)}, which pipeloom does not run")
    modules = {"layers.*.self_attn": "region_input", **attention, "embed": "vocab_embedding", "head": "vocab_head"}
    return TensorParallelPlan(modules, adjust=_shard_positions)
