"""Where each group sits on the cluster, the splits a search weighs, and what tp and cp cost."""

import json
from dataclasses import replace

import pytest

from pipeloom import ConfigError
from pipeloom.cli import main
from pipeloom.tune.analytic import kv_exchange_bytes, layer_figures
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import tune
from pipeloom.tune.topology import Split, splits

GIB = 2**30
A100 = load_hardware("a100-80g")  # 8 GPUs a node, NVLink 300 GB/s, network 25 GB/s


def _links(split: Split, dp: int, pp: int, gpus_per_node: int = 8) -> dict[str, str]:
    links = split.links(dp, pp, gpus_per_node, A100.nvlink_bandwidth, A100.network_bandwidth)
    return {name: link.name for name, link in links.items()}


def test_groups_span_consecutive_ranks_tp_innermost():
    # tp 8 fills an 8-GPU node; every other group's ranks are 8 apart: other nodes
    assert _links(Split(tp=8), dp=4, pp=2) == {
        "tp": "NVLink",
        "cp": "NVLink",
        "ep": "NVLink",
        "dp": "network",
        "pp": "network",
    }
    # tp 2 × dp 4 is one node; the pipeline leaves it
    assert _links(Split(tp=2), dp=4, pp=2) == {
        "tp": "NVLink",
        "cp": "NVLink",
        "ep": "NVLink",
        "dp": "NVLink",
        "pp": "network",
    }
    # the same tp 8 on 4-GPU nodes crosses the network
    assert _links(Split(tp=8), dp=1, pp=1, gpus_per_node=4)["tp"] == "network"
    # cp sits outside tp: tp 4 × cp 2 fills the node, tp 4 × cp 4 leaves it
    assert _links(Split(tp=4, cp=2), dp=1, pp=2)["cp"] == "NVLink"
    assert _links(Split(tp=4, cp=4), dp=1, pp=1)["cp"] == "network"
    # a whole pipeline inside one node sends its activations over NVLink
    assert _links(Split(), dp=2, pp=4)["pp"] == "NVLink" and _links(Split(), dp=2, pp=8)["pp"] == "network"


def test_the_default_splits_follow_the_node_and_the_model():
    llama = load_model("llama2-70b")  # 64 heads, 8 K/V heads
    found = splits(64, heads=64, kv_heads=8, ffn=llama.ffn, seq_len=32768, gpus_per_node=8)
    assert sorted({s.tp for s in found}) == [1, 2, 4, 8]  # the node's divisors
    assert sorted({s.cp for s in found}) == [1, 2, 4, 8, 16, 32]  # at least 1024 tokens a rank
    assert all(64 % (s.tp * s.cp) == 0 for s in found) and {s.ep for s in found} == {1}
    short = splits(64, heads=64, kv_heads=8, ffn=llama.ffn, seq_len=2048, gpus_per_node=8)
    assert {s.cp for s in short} == {1, 2}
    moe = splits(8, heads=32, kv_heads=8, ffn=None, seq_len=4096, num_experts=8, gpus_per_node=8)
    assert {s.ep for s in moe} == {1, 2, 4, 8}
    assert splits(8, heads=32, kv_heads=8, ffn=14336, seq_len=4096, tp=[2], cp=[1]) == [Split(tp=2)]


@pytest.mark.parametrize(
    "given, message",
    [
        (dict(tp=[16]), "--tp 16: llama's 8 key/value heads do not divide by 16"),
        (dict(cp=[3]), "--cp 3: llama's sequence of 4096 tokens does not cut into 6 equal chunks"),
        (dict(ep=[2]), "--ep 2: llama has no routed experts to share out"),
        (dict(tp=[0]), "--tp must be at least 1"),
    ],
)
def test_a_constraint_that_cannot_cut_the_model_is_refused(given, message):
    with pytest.raises(ConfigError, match=message):
        splits(16, heads=32, kv_heads=8, ffn=14336, seq_len=4096, name="llama", **given)


def test_context_parallelism_shares_tokens_and_exchanges_keys_and_values():
    model = replace(load_model("llama2-70b"), seq_len=32768)
    whole, quarter = layer_figures(model, 1, tp=2), layer_figures(model, 1, tp=2, cp=4)
    for field in ("forward_flops", "backward_flops", "weight_flops", "activation_bytes", "weight_grad_bytes"):
        assert getattr(quarter, field) == pytest.approx(getattr(whole, field) / 4)
    assert quarter.params == whole.params
    # each of 4 ranks all-gathers the others' K and V: 3 × its own 2 × 8192 tokens × 512 (its 4 of
    # 8 K/V heads' 1024 channels) 16-bit values
    assert kv_exchange_bytes(model, 1, tp=2, cp=4) == 3 * 2 * 2 * 8192 * 1024 / 2
    cost_model = AnalyticCostModel(model, load_hardware("h100"), tp=2, cp=4)
    exchanges = cost_model.exchange_times(1)
    kv_ms = 1e3 * (kv_exchange_bytes(model, 1, 2, 4) / 450e9 + 3 * 10e-6)  # tp 2 × cp 4 ranks: one node
    assert exchanges["cp"] == pytest.approx((kv_ms, kv_ms))
    # tp: two all-reduces each way of the rank's 8192 tokens × 8192 hidden 16-bit activations, each
    # ring sending 2(t − 1)/t of them in 2(t − 1) steps
    tp_ms = 1e3 * (2 * (2 * 8192 * 8192) * 2 * (1 / 2) / 450e9 + 2 * 2 * 10e-6)
    assert exchanges["tp"] == pytest.approx((tp_ms, tp_ms))
    first = cost_model.stage_costs([1, 1], 1, pp=2, dp=1)  # a layer and no head
    assert first.F[0] == pytest.approx(cost_model._ms(layer_figures(model, 1, 2, 4).forward_flops) + tp_ms + kv_ms)


def test_the_gradients_of_cp_ranks_are_summed_with_the_replicas():
    model = load_model("llama2-7b")
    plain, split = AnalyticCostModel(model, A100), AnalyticCostModel(model, A100, cp=2)
    assert plain.allreduce_time(1e9, pp=1, dp=1) == 0.0
    assert split.allreduce_time(1e9, pp=1, dp=1) == pytest.approx(plain.allreduce_time(1e9, pp=1, dp=2))
    assert split.optimizer_time(1e9, dp=2, zero=1) == pytest.approx(plain.optimizer_time(1e9, dp=4, zero=1))


def test_a_tensor_parallel_group_across_nodes_pays_the_network():
    model = load_model("gpt3-175b")
    inside = AnalyticCostModel(model, A100, tp=8).exchange_times(1)["tp"][0]
    across = AnalyticCostModel(model, replace(A100, gpus_per_node=4), tp=8).exchange_times(1)["tp"][0]
    ring = 2 * 2 * 2048 * 12288 * 2 * 7 / 8  # two all-reduces of the activations, 2(t−1)/t of them sent
    assert across - inside == pytest.approx(1e3 * ring * (1 / 25e9 - 1 / 300e9))


def test_the_search_over_splits_does_not_miss_its_own_best():
    """The search weighs every split in one ranking, pruned by true lower bounds: its best is the
    best of the searches with each split fixed in turn."""
    model = replace(load_model("llama2-7b"), layers=8)
    cost_model = AnalyticCostModel(model, load_hardware("h100"))
    space = dict(schemes=["1f1b", "zb-h1"], micro_batches=[1, 2], keep=3, layouts=False)
    every = splits(8, heads=32, kv_heads=32, ffn=model.ffn, seq_len=4096, gpus_per_node=8, cp=[1, 2])
    searched = tune(cost_model, 8, 80 * GIB, 16, splits=every, **space)
    fixed = [tune(cost_model.with_split(split), 8, 80 * GIB, 16, **space).best.step_time for split in every]
    assert searched.best.step_time == pytest.approx(min(fixed))
    assert {outcome.split for outcome in searched.splits} == set(every)


def test_tune_chooses_the_split_and_explains_it_by_its_links(capsys, tmp_path):
    plan_path = tmp_path / "plan.json"
    argv = ["tune", "--model", "llama2-7b", "--hardware", "h100", "--devices", "16", "--global-batch", "16"]
    argv += ["--seq-len", "16384", "--schemes", "1f1b", "--max-mbs", "1", "--explain", "--jobs", "1"]
    assert main([*argv, "--output", str(plan_path)]) == 0
    out = capsys.readouterr().out
    plan = json.loads(plan_path.read_text())
    assert plan["devices"] == plan["pp"] * plan["dp"] * plan["cp"] * plan["tp"] == 16
    assert plan["model"]["seq_len"] == 16384 and plan["cost_model"]["cp"] == plan["cp"]
    (why,) = [line for line in out.splitlines() if line.startswith("why tp=") or line.startswith("why cp=")]
    assert "on NVLink (450 GB/s)" in why and "searched tp 1, 2, 4, 8; cp 1, 2, 4, 8, 16" in why
    assert any(line.startswith("  tp=") for line in out.splitlines())
    # fixed by the user: that split only, and the plan records it
    assert main([*argv, "--tp", "2", "--cp", "4", "--output", str(plan_path), "--force"]) == 0
    assert (json.loads(plan_path.read_text())["tp"], json.loads(plan_path.read_text())["cp"]) == (2, 4)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--inter-bw", "fast"], "--inter-bw must be a bandwidth such as 450GB/s, got 'fast'"),
        (["--gpus-per-node", "0"], "--gpus-per-node must be at least 1"),
        (["--seq-len", "0"], "--seq-len must be at least 1"),
        (["--cp", "3"], "--cp 3: llama2-7b's sequence of 4096 tokens does not cut into 6 equal chunks"),
    ],
)
def test_bad_topology_flags_are_one_line(capsys, tmp_path, extra, message):
    argv = ["tune", "--model", "llama2-7b", "--hardware", "h100", "--devices", "8", "--global-batch", "8"]
    assert main([*argv, *extra, "--output", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_the_cluster_flags_override_the_preset(capsys, tmp_path):
    from pipeloom.cli.args import parse_bandwidth

    assert parse_bandwidth("450GB/s", "x") == 450e9 and parse_bandwidth("400Gb/s", "x") == 50e9
    assert parse_bandwidth("25", "x") == 25e9
    argv = ["tune", "--model", "llama2-7b", "--hardware", "h100", "--devices", "16", "--global-batch", "16"]
    argv += ["--schemes", "1f1b", "--tp", "8", "--cp", "1", "--pp", "2", "--max-mbs", "1", "--json", "--jobs", "1"]
    steps = []
    for cluster in ([], ["--gpus-per-node", "4"], ["--gpus-per-node", "4", "--inter-bw", "450GB/s"]):
        assert main([*argv, *cluster, "--output", str(tmp_path / f"{len(cluster)}.json")]) == 0
        steps.append(json.loads(capsys.readouterr().out)[0]["step_time_ms"])
    # tp 8 over 4-GPU nodes crosses the network; a network as fast as NVLink undoes that (and
    # speeds up the pipeline's sends, which left the node already)
    assert steps[1] > 2 * steps[0] and steps[2] < steps[0]
