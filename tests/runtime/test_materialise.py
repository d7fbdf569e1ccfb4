"""Stages built on the meta device and made real only where they are held: the same values
whatever the cut, and a shard read from the weight files is that slice of the saved tensor."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402

from pipeloom.models.hf import hf_model, hf_workload, load_hf_config  # noqa: E402
from pipeloom.models.materialise import Cut, materialise  # noqa: E402


def by_name(stages) -> dict[str, torch.Tensor]:
    return {stage.model_names[n]: t.detach() for stage in stages for n, t in stage.named_parameters()}


@pytest.mark.parametrize("family", ["llama", "gpt2", "mixtral"])
def test_every_cut_starts_from_the_same_weights(tmp_path, family):
    (tmp_path / "config.json").write_text(json.dumps(TINY[family]))
    work = hf_workload(tmp_path, seed=4, seq_len=16)
    whole, cut = by_name(work.build(1)), by_name(work.build(4))
    assert whole.keys() == cut.keys()
    assert all(torch.equal(whole[name], cut[name]) for name in whole)
    drawn = [name for name, value in whole.items() if value.dim() > 1]  # matrices; norms and biases are constants
    assert drawn and all(whole[name].std() > 0 for name in drawn)
    other = by_name(hf_workload(tmp_path, seed=5, seq_len=16).build(1))
    assert not any(torch.equal(other[name], whole[name]) for name in drawn)  # another seed, other draws


def test_a_shard_is_read_from_the_weight_files_as_that_slice(tmp_path):
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY["llama"]))
    saved = hf_model(tmp_path, load_hf_config(tmp_path), seed=9)
    tensors = {name: t.detach().clone() for name, t in saved.named_parameters()}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    skeleton = hf_workload(tmp_path, seed=0, seq_len=16).skeleton(2)  # seed 0: the values must come from the file
    stage = skeleton.stages[1]
    up = stage.layers[0].mlp.up_proj
    cuts = {}
    for index, parts in ((1, 1), (0, 2)):  # a plain cut, then one of two packed blocks each
        full = up.weight
        shard = torch.nn.Parameter(torch.empty_like(Cut(0, index, 2, parts).of(full)))
        cuts[id(shard)] = (full, Cut(0, index, 2, parts))
        materialise(skeleton, [torch.nn.ParameterList([shard])], cuts, torch.device("cpu"))
        name = stage.model_names["layers.0.mlp.up_proj.weight"]
        rows = tensors[name].shape[0]
        expected = (
            tensors[name][rows // 2 :]
            if parts == 1
            else torch.cat([tensors[name][: rows // 4], tensors[name][rows // 2 : 3 * rows // 4]])
        )
        assert torch.equal(shard.detach(), expected)
    materialise(skeleton, [stage], {}, torch.device("cpu"))
    assert torch.equal(stage.norm.weight.detach(), tensors["model.norm.weight"])
    assert torch.equal(stage.head.weight.detach(), tensors["model.embed_tokens.weight"])  # tied: one tensor


def test_a_mixture_saved_expert_by_expert_is_read_expert_by_expert(tmp_path):
    """Mixtral's save_pretrained writes each expert apart; the library's conversion mapping stacks
    them — an expert-parallel rank reads only its experts' tensors."""
    from pipeloom.models.hf_weights import ConvertedWeights

    (tmp_path / "config.json").write_text(json.dumps(TINY["mixtral"]))
    saved = hf_model(tmp_path, load_hf_config(tmp_path), seed=9)
    saved.save_pretrained(tmp_path)
    expected = {name: t.detach().clone() for name, t in saved.named_parameters()}
    skeleton = hf_workload(tmp_path, seed=0, seq_len=16).skeleton(1)
    assert isinstance(skeleton._weights, ConvertedWeights)
    assert not any("gate_up_proj" in key for key in skeleton._weights.raw.files)  # saved apart
    stage = skeleton.stages[0]
    experts = stage.layers[1].mlp.experts
    full = experts.gate_up_proj
    shard = torch.nn.Parameter(torch.empty_like(Cut(0, 1, 2).of(full)))
    materialise(skeleton, [torch.nn.ParameterList([shard])], {id(shard): (full, Cut(0, 1, 2))}, torch.device("cpu"))
    assert torch.equal(shard.detach(), expected["model.layers.1.mlp.experts.gate_up_proj"][2:])
    materialise(skeleton, [stage], {}, torch.device("cpu"))
    assert all(torch.equal(t.detach(), expected[stage.model_names[n]]) for n, t in stage.named_parameters())


def test_making_weights_real_draws_from_the_host_generator_alone(tmp_path, monkeypatch):
    """Initialising a unit reseeds the host's generator, then restores it; torch.manual_seed also
    reseeded every accelerator's generator (CUDA's included), which nothing restored."""
    reseeded: list[str] = []
    for module in (torch.cuda, torch.xpu, torch.mtia):
        monkeypatch.setattr(module, "manual_seed_all", lambda seed, name=module.__name__: reseeded.append(name))
    (tmp_path / "config.json").write_text(json.dumps(TINY["llama"]))
    state = torch.random.get_rng_state()
    work = hf_workload(tmp_path, seed=4, seq_len=16)
    work.build(2)
    assert reseeded == [] and torch.equal(torch.random.get_rng_state(), state)
