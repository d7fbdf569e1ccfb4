"""Real models under the runtime: Hugging Face LLaMA-family, GPT-2, BERT and Mamba, and a
torchvision ResNet, each trained by pipelines exactly like one process (every device in this
process; fp16 loss scaling and resuming, which need ranks, forked over gloo).

Reference: `reference_training`, the same library model cut into the same stages, run in one
process on the same micro-batches (fp32: rtol 1e-5 on losses and every parameter)."""

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402
from helpers.runtime import assert_resumes_bit_identically, saved_midway, trains_like_one_process  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.models.vision import resnet_workload  # noqa: E402
from pipeloom.passes import apply_checkpoint, split_backward  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

SCHEDULES = {"1f1b": {}, "zb-h1": {}, "interleaved": {"num_chunks": 2}, "zb-v": {}}


def model_dir(tmp_path, family, **changes):
    directory = tmp_path / family
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY[family], **changes}))
    return directory


def schedule_for(name, p=2, m=4, **extra):
    return build_schedule(name, p, m, **{**SCHEDULES.get(name, {}), **extra})


def assert_trains_like_one_process(spec, rtol=1e-5, atol=None):
    return trains_like_one_process(spec, rtol, atol)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert", "mamba"])
def test_hf_models_train_like_one_process(tmp_path, family, schedule):
    """Four stages each: chunks of the model on each device with fused backwards, and a V with a
    split backward (B, then W) whose first and last stages share a device (a tied embedding's two ends)."""
    work = hf_workload(model_dir(tmp_path, family), seed=1, microbatch_size=2, seq_len=16)
    assert_trains_like_one_process(TrainSpec(schedule_for(schedule), steps=3, workload=work))


@pytest.mark.parametrize("family", ["mistral", "qwen2"])
def test_other_llama_family_configs_train_like_one_process(tmp_path, family):
    work = hf_workload(model_dir(tmp_path, family), seed=2, microbatch_size=2, seq_len=16)
    assert_trains_like_one_process(TrainSpec(schedule_for("zb-h1"), steps=3, workload=work))


@pytest.mark.parametrize("family, schedule", [("mixtral", "zb-h1"), ("qwen2_moe", "1f1b"), ("qwen3_moe", "zb-v")])
def test_mixture_of_experts_models_train_like_one_process(tmp_path, family, schedule):
    """Dense expert loops (no --ep); Mixtral's and Qwen3-MoE's load-balancing loss reads every
    layer's router logits, handed on from stage to stage with their gradients."""
    work = hf_workload(model_dir(tmp_path, family), seed=2, microbatch_size=2, seq_len=16)
    assert work.experts is not None and work.experts.num_experts == 4
    assert_trains_like_one_process(TrainSpec(schedule_for(schedule), steps=2, workload=work))


def test_the_load_balancing_loss_is_the_librarys(tmp_path):
    from pipeloom.models.hf import hf_model, load_hf_config
    from pipeloom.models.workload import token_loss

    directory = model_dir(tmp_path, "mixtral")
    work = hf_workload(directory, seed=2, microbatch_size=2, seq_len=16)
    tokens, targets = work.batch(2, 0)
    first, last = work.build(2)
    handed = first(tokens)
    assert handed[1].shape == (2 * 2 * 16, 4)  # two layers' router logits per token
    output = last(*handed)
    library = hf_model(directory, load_hf_config(directory), 2)(tokens, output_router_logits=True)
    aux = (work.loss(output, targets) - token_loss(output[0], targets)) / 0.01
    assert float(aux.detach()) == pytest.approx(
        float(library.aux_loss.detach()), rel=1e-4
    )  # a difference of two fp32 losses / 0.01


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_causal_lms_train_slice_by_slice(tmp_path, family):
    work = hf_workload(model_dir(tmp_path, family), seed=3, microbatch_size=2, seq_len=16)
    schedule = build_schedule("svpp", 2, 4, num_chunks=2, num_slices=2)
    # Slice by slice, attention sums in another order (see test_runtime's tolerance note).
    assert_trains_like_one_process(TrainSpec(schedule, steps=3, workload=work), rtol=1e-4, atol=5e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2", "resnet"])
def test_partial_recompute_of_real_models_trains_like_one_process(tmp_path, family):
    """--recompute-layers 1: each checkpointed forward re-runs its stage's embedding and first
    layer (block) only; the gradients are those of the plain run."""
    if family == "resnet":
        work = resnet_workload("resnet18", microbatch_size=2, image_size=32, seed=4)
    else:
        work = hf_workload(model_dir(tmp_path, family), seed=5, microbatch_size=2, seq_len=16)
    schedule = apply_checkpoint(split_backward(schedule_for("1f1b"), "after"))
    results = assert_trains_like_one_process(TrainSpec(schedule, steps=2, workload=work, recompute_layers=1), atol=1e-5)
    assert all(result.records[0].recomputes == 4 for result in results)


def test_torchvision_resnet_trains_like_one_process():
    """Four stages of convolutions (batch norms in them) in a V, under the B/W split; the partial
    recompute test runs them checkpointed."""
    work = resnet_workload("resnet18", microbatch_size=2, image_size=32, seed=4)
    assert_trains_like_one_process(TrainSpec(schedule_for("zb-v"), steps=2, workload=work), atol=1e-5)


def test_tied_embeddings_get_the_summed_gradient_of_both_ends(tmp_path):
    """Embedding on rank 0, head on rank 1: one logical weight, its gradient the sum of both uses.

    Each micro-batch's two contributions t_k (through the lookup, through the head) are computed
    alike in both runs; only the order in which the 2m of them are summed differs (each end over
    its micro-batches then the all-reduce, against one process's running sum). Any order of n
    fp32 additions lies within γ_n·Σ|t_k| of the exact sum (Higham, Accuracy and Stability of
    Numerical Algorithms, §4.2; γ_n = nu/(1 − nu), u = 2⁻²⁴, one more rounding for the 1/m
    scale), so two orders differ by at most 2·γ_n·Σ|t_k| — a bound from the terms' magnitudes,
    whatever the CPU or its load."""
    work = hf_workload(model_dir(tmp_path, "llama"), seed=5, microbatch_size=2, seq_len=16)
    spec = TrainSpec(schedule_for("1f1b"), steps=1, workload=work, record_gradients=True)
    results = run_in_process(spec)
    expected = []
    reference_training(spec, gradients=expected)
    embedding = results[0].gradients[0]["embed.weight"]
    head = results[1].gradients[1]["head.weight"]
    torch.testing.assert_close(embedding, head, rtol=0, atol=0)
    terms = _tied_terms(spec)
    n = len(terms) + 1
    unit = 2.0**-24
    bound = 2 * (n * unit / (1 - n * unit)) * torch.stack(terms).abs().sum(dim=0)
    reference = expected[0]["embed.weight"]
    assert ((embedding - reference).abs() <= bound).all()
    assert ((torch.stack(terms).sum(dim=0) - reference).abs() <= bound).all()  # the terms are the sum's
    # Neither end alone: the head's own contribution is a real part of the sum.
    assert not torch.allclose(embedding, torch.zeros_like(embedding))
    assert float(torch.stack(terms[1::2]).abs().max()) > 0
    torch.testing.assert_close(results[0].parameters[0]["embed.weight"], results[1].parameters[1]["head.weight"])


def _tied_terms(spec) -> list:
    """Per micro-batch, the tied weight's gradient through the lookup and through the head, each
    alone: the head given its own copy of the weight, each micro-batch's backward on its own."""
    from pipeloom.models.workload import rows_of
    from pipeloom.runtime.precision import Precision
    from pipeloom.runtime.stage_call import run_stage

    work = spec.resolved_workload()
    first, last = work.build(2)
    lookup = dict(first.named_parameters())["embed.weight"]
    head_module = dict(last.named_modules())["head"]
    head_module.weight = torch.nn.Parameter(head_module.weight.detach().clone())
    micro, rows = spec.schedule.num_microbatches, work.microbatch_size
    inputs, targets = work.batch(micro * rows, 0)
    terms = []
    for j in range(micro):
        for parameter in (*first.parameters(), *last.parameters()):
            parameter.grad = None
        x = rows_of(inputs, slice(j * rows, (j + 1) * rows))
        for index, stage in enumerate((first, last)):
            x, _ = run_stage(stage, x, None, Precision("fp32"), torch.device("cpu"), hand_on=index == 0)
        (work.loss(x[0], targets[j * rows : (j + 1) * rows]).float() / micro).backward()
        terms += [lookup.grad.clone(), head_module.weight.grad.clone()]
    return terms


def test_tied_embeddings_on_one_device_of_a_v_shape(tmp_path):
    """ZB-V puts the first and the last stage on device 0: one parameter object, reduced once."""
    work = hf_workload(model_dir(tmp_path, "gpt2"), seed=6, microbatch_size=2, seq_len=16)
    spec = TrainSpec(schedule_for("zb-v"), steps=2, dp=2, workload=work)
    assert_trains_like_one_process(spec)


def test_bf16_stays_close_to_fp32_and_sends_half_the_bytes(tmp_path):
    from pipeloom.data import TokenFile, write_token_file

    learnable = write_token_file(tmp_path / "cycle.bin", [(7 * i) % 96 for i in range(4000)])  # next id is fixed
    data = TokenFile(learnable, seq_len=16, seed=0)
    work = hf_workload(model_dir(tmp_path, "llama"), seed=7, microbatch_size=2, seq_len=16, data=data)
    schedule = schedule_for("zb-h1")
    fp32 = run_in_process(TrainSpec(schedule, steps=20, lr=3e-3, workload=work))
    bf16 = run_in_process(TrainSpec(schedule, steps=20, lr=3e-3, workload=work, dtype="bf16"))
    for record32, record16 in zip(fp32[0].records, bf16[0].records):
        assert record16.sent_dtypes == ("bfloat16",) and record32.sent_dtypes == ("float32",)
        assert record16.sent_bytes * 2 == record32.sent_bytes
    # Stated tolerance: every bf16 loss within 2 % of fp32's over 20 steps, and both learn.
    assert bf16[0].losses == pytest.approx(fp32[0].losses, rel=0.02)
    assert bf16[0].losses[-1] < bf16[0].losses[0] - 0.5
    # Master weights stay fp32.
    assert all(t.dtype == torch.float32 for t in bf16[0].parameters[0].values())


def test_bf16_pipeline_matches_a_bf16_single_process_run(tmp_path):
    work = hf_workload(model_dir(tmp_path, "gpt2"), seed=8, microbatch_size=2, seq_len=16)
    spec = TrainSpec(schedule_for("1f1b"), steps=3, workload=work, dtype="bf16")
    assert_trains_like_one_process(spec, rtol=1e-2, atol=1e-3)


def test_fp16_loss_scale_skips_an_overflow_alike_with_post_validation(tmp_path):
    work = hf_workload(model_dir(tmp_path, "llama"), seed=9, microbatch_size=2, seq_len=16)
    base = dict(steps=4, workload=work, dtype="fp16", gradient_faults=((1, 1, "inf", 0.0),))
    sync = run_local(TrainSpec(schedule_for("zb-h1"), **base))
    post = run_local(TrainSpec(schedule_for("zb-h1"), post_validation=True, **base))
    clipped = run_local(TrainSpec(schedule_for("zb-h1"), clip_norm=1.0, post_validation=True, **base))
    for results in (sync, post, clipped):
        assert results[0].loss_scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        assert all(result.skipped_steps == 1 for result in results)
    assert post[0].losses == pytest.approx(sync[0].losses, rel=1e-6)
    # Device 0 stepped optimistically at the overflow and rolled back: exact arithmetic, not
    # exact floating point (as in test_post_validation).
    assert post[0].rollbacks == 1 and post[1].rollbacks == 0
    for ours, theirs in zip(post, sync):
        for stage, parameters in ours.parameters.items():
            for name, value in parameters.items():
                torch.testing.assert_close(value, theirs.parameters[stage][name], rtol=1e-5, atol=1e-5)


def test_resume_with_a_token_file_continues_on_the_same_samples(tmp_path):
    from pipeloom.data import TokenFile, write_token_file

    ids = torch.randint(0, 96, (5000,), generator=torch.Generator().manual_seed(0))
    path = write_token_file(tmp_path / "tokens.bin", ids.numpy(), "uint16")
    data = TokenFile(path, seq_len=16, seed=3)
    work = hf_workload(model_dir(tmp_path, "llama"), seed=10, microbatch_size=2, seq_len=16, data=data)
    spec = TrainSpec(schedule_for("zb-h1"), steps=4, workload=work)
    whole, checkpoint = saved_midway(spec, tmp_path / "ckpt")
    assert_resumes_bit_identically(spec, whole, checkpoint)


def test_boundaries_may_differ_in_shape_and_carry_tuples():
    """A block hands on a (hidden, mask) pair; another changes the width."""
    from pipeloom.models.workload import blocks_workload

    class WithMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 6)

        def forward(self, x):
            return torch.tanh(self.linear(x)), (x[:, :1] > 0).long()

    class UseMask(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 4)

        def forward(self, x, mask):
            return self.linear(x) * (1 + mask)

    def blocks():
        torch.manual_seed(11)
        return [WithMask(), UseMask(), torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)]

    def batch(rows, step):
        x = torch.randn(rows, 8, generator=torch.Generator().manual_seed(step))
        return x, x.flip(-1)

    work = blocks_workload(blocks, batch, torch.nn.functional.mse_loss, microbatch_size=3)
    for name in ("1f1b", "zb-h1"):
        assert_trains_like_one_process(TrainSpec(schedule_for(name, p=4, m=4), steps=3, workload=work))


def test_probing_the_boundaries_keeps_no_tensor_alive(tmp_path):
    """The launcher's probe packed each saved tensor as itself, which its own grad_fn then held:
    a cycle through C++ that Python's collector cannot free, so every run a process launched
    (`train_plan` in a loop, the CLI fuzz) kept its probe's model and activations, 0.7 MB each."""
    import gc

    from pipeloom.runtime.probe import probe_spec

    (tmp_path / "config.json").write_text(json.dumps(TINY["llama"]))
    spec = TrainSpec(build_schedule("1f1b", 2, 2), workload=hf_workload(tmp_path, microbatch_size=2, seq_len=16))

    def live_tensors() -> int:
        gc.collect()
        return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())

    probe_spec(spec)  # what the first call builds once (caches, the workload's own tensors)
    before = live_tensors()
    for _ in range(3):
        probe_spec(spec)
    assert live_tensors() == before


def test_bad_models_are_refused(tmp_path):
    from pipeloom.models.hf import load_hf_config

    with pytest.raises(ConfigError, match="does not exist"):
        load_hf_config(tmp_path / "missing")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_hf_config(broken)
    with pytest.raises(ConfigError, match="'t5' is not supported"):
        load_hf_config(model_dir(tmp_path, "llama", model_type="t5"))
    work = hf_workload(model_dir(tmp_path, "llama"), microbatch_size=2, seq_len=16)
    from pipeloom.runtime.training import check_spec

    with pytest.raises(ConfigError, match="4 layers cannot be cut into 8 stages"):
        check_spec(TrainSpec(build_schedule("1f1b", 8, 8), workload=work))
    for top_k in (5, 0):  # the router's top-k failed inside the first forward
        with pytest.raises(ConfigError, match=f"routes each token to {top_k} experts .* the model has 4"):
            hf_workload(model_dir(tmp_path, "mixtral", num_experts_per_tok=top_k), microbatch_size=2, seq_len=16)
    layer_types = ["full_attention", "sliding_attention", "full_attention"]
    with pytest.raises(ConfigError, match="malformed: .*layer_types") as refused:  # 4 layers, 3 kinds
        load_hf_config(model_dir(tmp_path, "qwen2", layer_types=layer_types))
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("family", ["qwen2", "qwen2_moe"])
def test_a_probe_of_fewer_layers_keeps_the_first_layers_kinds(tmp_path, family):
    """Qwen2's config lists each layer's attention (`layer_types`, sliding past `max_window_layers`):
    a probe of n layers (`profile --layers`) holds the model's first n, and one of more than the
    model has repeats its pattern — a config the library itself accepts, whose parameters count."""
    from pipeloom.models.hf import load_hf_config
    from pipeloom.models.memory_guard import hf_parameter_count

    directory = model_dir(tmp_path, family, use_sliding_window=True, sliding_window=16, max_window_layers=1)
    pattern = load_hf_config(directory).layer_types
    assert len(pattern) == 4 and pattern[0] != pattern[1]  # both kinds, the first layer's its own
    for layers, kinds in ((1, pattern[:1]), (6, (pattern * 2)[:6])):
        config = load_hf_config(directory, layers)
        assert (config.num_hidden_layers, config.layer_types) == (layers, kinds)
        assert hf_parameter_count(config) > 0
        work = hf_workload(directory, microbatch_size=1, seq_len=16, layers=layers)
        assert work.check(1) == [layers]
