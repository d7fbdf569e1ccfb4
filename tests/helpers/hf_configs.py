"""Tiny configs of every Hugging Face family the runtime cuts (what the model tests build)."""

_DECODER = {  # the shape LLaMA, Mistral and Qwen2 share here, grouped-query attention included
    "vocab_size": 96,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}
_EXPERTS = {  # four experts, two per token; Mixtral's load-balancing loss crosses the pipeline
    **_DECODER,
    "num_experts_per_tok": 2,
    "output_router_logits": True,
    "router_aux_loss_coef": 0.01,
}
TINY = {
    "llama": {**_DECODER, "model_type": "llama", "tie_word_embeddings": True},
    "mistral": {**_DECODER, "model_type": "mistral", "sliding_window": 64},
    "qwen2": {**_DECODER, "model_type": "qwen2", "tie_word_embeddings": True},
    "gpt2": {
        "model_type": "gpt2",
        "vocab_size": 96,
        "n_embd": 32,
        "n_layer": 4,
        "n_head": 2,
        "n_positions": 64,
        "bos_token_id": 0,
        "eos_token_id": 0,
    },
    "bert": {
        "model_type": "bert",
        "vocab_size": 96,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
    },
    "mamba": {
        "model_type": "mamba",
        "vocab_size": 96,
        "hidden_size": 32,
        "num_hidden_layers": 4,
        "state_size": 8,
        "expand": 2,
        "conv_kernel": 4,
    },
    "mixtral": {**_EXPERTS, "model_type": "mixtral", "num_local_experts": 4},
    "qwen2_moe": {  # a shared expert beside the routed ones, every layer sparse
        **_EXPERTS,
        "model_type": "qwen2_moe",
        "num_experts": 4,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
        "output_router_logits": False,
    },
    "qwen3_moe": {**_EXPERTS, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 32},
}


def with_layers(config: dict, layers: int) -> dict:
    """`config` with `layers` decoder (or encoder) layers, under its family's name for the count."""
    key = "n_layer" if config["model_type"] == "gpt2" else "num_hidden_layers"
    return {**config, key: layers}
