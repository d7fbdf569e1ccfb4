"""Analytic FLOPs and memory (Zero Bubble Table 1, Korthikanti et al.), presets, the partitioner."""

import json
from dataclasses import replace

import pytest

from pipeloom import ConfigError, InfeasibleError
from pipeloom.tune.analytic import head_figures, layer_figures, static_bytes_per_param
from pipeloom.tune.partition import layout_string, partition_layers
from pipeloom.tune.presets import MODEL_PRESETS, load_hardware, load_model


@pytest.mark.parametrize("b", [1, 2, 4])
def test_gpt3_13b_matches_zero_bubble_table_1(b):
    model = load_model("gpt3-13b")  # Mario Table 4: hidden 3000, 128 layers, 40 heads, sequence 1024
    s, h, a = 1024, 3000, 40
    layer = layer_figures(model, b)
    assert layer.forward_flops == s * b * h * (24 * h + 4 * s)
    assert layer.backward_flops == s * b * h * (24 * h + 8 * s)
    assert layer.weight_flops == s * b * h * (24 * h)
    assert layer.activation_bytes == s * b * (34 * h + 5 * a * s)  # Korthikanti, no recompute, 16-bit
    assert layer.weight_grad_bytes == 32 * s * b * h
    assert 13.5e9 < model.params < 14.5e9  # "13B" in the paper; embedding and head included here


def test_llama2_13b_with_the_swiglu_mlp_written_out():
    model = load_model("llama2-13b")  # Mario Table 4: hidden 4096, 64 layers, 32 heads, sequence 1024
    s, h, a, f, b = 1024, 4096, 32, 11008, 2
    weights = 4 * h * h + 3 * h * f  # q, k, v, o; gate, up, down
    layer = layer_figures(model, b)
    assert layer.forward_flops == 2 * s * b * weights + 4 * s * s * b * h
    assert layer.backward_flops == 2 * s * b * weights + 8 * s * s * b * h
    assert layer.weight_flops == 2 * s * b * weights
    # Korthikanti's 34 = 10 outside the tensor-parallel regions + 8 attention + 16 for GPT's 4h MLP
    # (two 4h outputs of two bytes); SwiGLU keeps gate, up, SiLU(gate) and their product: 8f.
    assert layer.activation_bytes == s * b * (10 * h + 8 * h + 8 * f) + 5 * a * s * s * b
    assert 12.5e9 < model.params < 13.5e9


def test_tensor_parallelism_divides_what_it_shards():
    model = load_model("gpt3-13b")
    one, two = layer_figures(model, 1), layer_figures(model, 1, tp=2)
    s, h, a = 1024, 3000, 40
    assert two.forward_flops == one.forward_flops / 2
    assert two.activation_bytes == s * h * (10 + 24 / 2 + 5 * a * s / (h * 2))  # Korthikanti with t = 2
    assert head_figures(model, 1).activation_bytes == 4 * s * model.vocab
    assert static_bytes_per_param(1) == 16 and static_bytes_per_param(1, zero=1) == 18
    assert static_bytes_per_param(4, zero=1) == 9 and static_bytes_per_param(4, zero=2) == 2 + 2 + 16 / 4


def test_presets_and_hf_configs(tmp_path):
    assert {"gpt3-1.6b", "gpt3-13b", "gpt3-175b", "llama2-3b", "llama2-7b", "llama2-13b", "llama2-70b"} <= set(
        MODEL_PRESETS
    )
    assert 170e9 < load_model("gpt3-175b").params < 180e9 and 65e9 < load_model("llama2-70b").params < 72e9
    assert load_hardware("A100-40G").memory == 40 * 2**30
    config = tmp_path / "model.json"
    config.write_text(
        json.dumps(
            {
                "hidden_size": 64,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "intermediate_size": 128,
                "vocab_size": 100,
                "hidden_act": "silu",
            }
        )
    )
    model = load_model(config)
    assert (model.hidden, model.layers, model.ffn, model.vocab, model.gated) == (64, 4, 128, 100, True)
    for bad, message in [("gpt5", "unknown model"), (tmp_path / "none.json", "cannot read")]:
        with pytest.raises(ConfigError, match=message):
            load_model(bad)
    with pytest.raises(ConfigError, match="unknown hardware"):
        load_hardware("tpu")


def test_partition_balances_time_around_the_embedding_and_head():
    assert partition_layers(8, [1, 1, 1, 1], [1, 0, 0, 1]) == [1, 3, 3, 1]
    assert partition_layers(22, [1] * 8, [1] + [0] * 6 + [1]) == [2, 3, 3, 3, 3, 3, 3, 2]  # Zero Bubble's layout
    counts = partition_layers(128, [1.0] * 32, [0.0] * 31 + [2.5])  # a head worth 2.5 layers
    assert sum(counts) == 128 and counts[-1] == 2 and max(counts) == 5  # bottleneck 5: the best possible
    assert layout_string([1, 3, 3, 1]) == "Et|ttt|ttt|tL"
    with pytest.raises(InfeasibleError, match="cannot fill"):
        partition_layers(3, [1] * 4, [0] * 4)


def test_partition_is_optimal_against_brute_force():
    import itertools

    per_layer, extra = [1.0, 1.0, 2.0], [0.7, 0.0, 1.5]
    best = min(
        max(n * c + e for n, c, e in zip(counts, per_layer, extra))
        for counts in itertools.product(range(1, 10), repeat=3)
        if sum(counts) == 10
    )
    counts = partition_layers(10, per_layer, extra)
    assert max(n * c + e for n, c, e in zip(counts, per_layer, extra)) == best


MIXTRAL = {
    "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "intermediate_size": 14336, "vocab_size": 32000, "max_position_embeddings": 4096, "hidden_act": "silu",
    "num_local_experts": 8, "num_experts_per_tok": 2,
}  # fmt: skip


def test_mixture_of_experts_from_an_hf_config():
    from pipeloom.tune.presets import model_from_config

    dense_ep = model_from_config(MIXTRAL, name="mixtral")
    assert dense_ep.params == pytest.approx(46.7e9, rel=0.01)  # Mixtral 8x7B's published size
    spread = model_from_config({**MIXTRAL, "expert_parallel": 8})
    expert = 3 * 4096 * 14336
    assert dense_ep.stored_layer_params - spread.stored_layer_params == 7 * expert  # 8 experts → 1 per GPU
    assert spread.layer_params == dense_ep.layer_params  # FLOPs follow the top-2 experts wherever they live
    top2 = layer_figures(spread, 1).forward_flops
    top1 = layer_figures(model_from_config({**MIXTRAL, "num_experts_per_tok": 1}), 1).forward_flops
    assert top2 - top1 == pytest.approx(2 * 4096 * expert)
    with pytest.raises(ConfigError, match="expert_parallel \\(3\\) must divide num_experts"):
        model_from_config({**MIXTRAL, "expert_parallel": 3})
    with pytest.raises(ConfigError, match="exceeds num_experts"):
        model_from_config({**MIXTRAL, "num_experts_per_tok": 9})


def test_expert_all_to_all_is_priced_inside_forward_and_backward():
    from pipeloom.tune.analytic import all_to_all_bytes
    from pipeloom.tune.cost_model import AnalyticCostModel
    from pipeloom.tune.presets import model_from_config

    h100 = load_hardware("h100")
    local = AnalyticCostModel(model_from_config(MIXTRAL), h100)
    assert local.stage_costs([8] * 4, 1, 4, 1).a2a_F == 0.0  # every expert on the GPU: nothing moves
    in_node = model_from_config({**MIXTRAL, "expert_parallel": 8})
    across = model_from_config({**MIXTRAL, "expert_parallel": 8, "num_local_experts": 16})
    assert all_to_all_bytes(in_node, 2) == 2 * 2 * 4096 * 4096 * 2 * 7 / 8
    costs = AnalyticCostModel(in_node, h100).stage_costs([8] * 4, 1, 4, 1)
    per_layer = 2 * (h100.latency + all_to_all_bytes(in_node, 1) / h100.nvlink_bandwidth) * 1e3
    assert costs.a2a_F == costs.a2a_B == tuple([8 * per_layer] * 4)
    wide = AnalyticCostModel(replace(across, expert_parallel=16), h100).all_to_all_time(1)
    assert wide > 5 * AnalyticCostModel(across, h100).all_to_all_time(1)  # 16 GPUs: over the network
