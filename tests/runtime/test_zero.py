"""ZeRO-1/2 and offloaded optimizers in the runtime: same training, the planned static bytes."""

import pytest

torch = pytest.importorskip("torch")

from helpers.runtime import assert_resumes_bit_identically, saved_midway  # noqa: E402

from pipeloom import ConfigError, build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec, reference_training  # noqa: E402
from pipeloom.static_memory import static_bytes  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def _close(results, reference_parameters, rtol=1e-5, atol=1e-6):
    for result in results:
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                torch.testing.assert_close(value.float(), reference_parameters[stage][name], rtol=rtol, atol=atol)


@pytest.mark.parametrize("name, zero", [("1f1b", 2), ("zb-v", 1)])
def test_sharded_optimizer_trains_like_one_unsharded_process(name, zero):
    spec = TrainSpec(build_schedule(name, 2, 4), config=CONFIG, steps=3, dp=2, zero=zero)
    results = run_local(spec)
    losses, parameters = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    _close(results, parameters)
    for result in results:  # every rank holds what the planner counts, the optimizer 1/dp of it
        count = sum(v.numel() for stage in result.parameters.values() for v in stage.values())
        planned = static_bytes(count, dp=2, zero=zero, compute=4, padded=True)
        assert result.static_bytes["optimizer"] == planned.optimizer == 12 * -(-count // 2)
        assert result.static_bytes == result.planned_static_bytes
        assert result.held_bytes["parameters"] == sum(result.planned_static_bytes.values())
        if zero == 1:  # each stage's sum over the replicas started as its last backward ended
            device = spec.parallelism.layout.coords(result.rank)[1]
            started = {stages for stages, _ in result.records[-1].grad_sync_starts}
            assert started == {(stage,) for stage in spec.schedule.stages_on(device)}


def test_bf16_weights_with_sharded_fp32_masters_match_the_plan():
    spec = TrainSpec(build_schedule("zb-h1", 2, 4), config=CONFIG, steps=3, dp=2, zero=1, dtype="bf16")
    results = run_local(spec)
    losses, _ = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=2e-3)
    for result in results:
        assert all(v.dtype == torch.bfloat16 for stage in result.parameters.values() for v in stage.values())
        count = sum(v.numel() for stage in result.parameters.values() for v in stage.values())
        assert result.static_bytes["weights"] == 2 * 2 * -(-count // 2)  # bf16, padded to equal shards
        assert result.static_bytes["gradients"] == 4 * 2 * -(-count // 2)  # fp32
        assert result.static_bytes == result.planned_static_bytes


def test_clipping_and_post_validation_see_the_whole_sharded_gradient():
    base = dict(config=CONFIG, steps=3, dp=2, clip_norm=0.5, post_validation=True)
    faults = ((1, 0, "scale", 100.0),)  # a blown-up step 1: clipped, rolled back on device 0
    plain = run_local(TrainSpec(build_schedule("zb-h1", 2, 4), gradient_faults=faults, **base))
    sharded = run_local(TrainSpec(build_schedule("zb-h1", 2, 4), gradient_faults=faults, zero=2, **base))
    assert sharded[0].losses == pytest.approx(plain[0].losses, rel=1e-6)
    assert [r.rollbacks for r in sharded] == [r.rollbacks for r in plain]
    assert plain[0].rollbacks > 0
    for result, other in zip(sharded, plain):
        _close([result], other.parameters)


def test_host_stepped_stages_are_clipped_and_rolled_back_alike():
    base = dict(config=CONFIG, steps=3, clip_norm=0.5, post_validation=True, gradient_faults=((1, 1, "scale", 100.0),))
    plain = run_local(TrainSpec(build_schedule("zb-h1", 2, 4), **base))
    offloaded = run_local(TrainSpec(build_schedule("zb-h1", 2, 4), offload_stages=(1,), **base))
    assert offloaded[0].losses == pytest.approx(plain[0].losses, rel=1e-6)
    assert [r.rollbacks for r in offloaded] == [r.rollbacks for r in plain] and plain[0].rollbacks > 0
    for result, other in zip(offloaded, plain):
        _close([result], other.parameters)


def test_resume_from_a_sharded_checkpoint_is_bit_identical(tmp_path):
    spec = TrainSpec(build_schedule("1f1b", 2, 4), config=CONFIG, dp=2, zero=2, dtype="bf16", steps=4)
    whole, checkpoint = saved_midway(spec, tmp_path)
    assert_resumes_bit_identically(spec, whole, checkpoint)
    # the shards' weights and moments are also saved by name: ZeRO-1 resumes them (bf16 gradient
    # sums under ZeRO-2, fp32 under ZeRO-1: the losses part by bf16's rounding, 2⁻⁸ of a gradient)
    other = run_local(spec.changed(zero=1, resume_dir=checkpoint))
    assert other[0].losses == pytest.approx(whole[0].losses[2:], rel=1e-3)


def test_resume_with_offloaded_and_sharded_optimizers_is_bit_identical(tmp_path):
    """Stage 1's optimizer on the host, stage 0's sharded over the replicas (device 1 keeps none)."""
    spec = TrainSpec(build_schedule("1f1b", 2, 4), config=CONFIG, dp=2, zero=1, offload_stages=(1,), steps=4)
    whole, checkpoint = saved_midway(spec, tmp_path)
    losses, parameters = reference_training(spec)
    assert whole[0].losses == pytest.approx(losses, rel=1e-5)  # the host's stage too is summed over replicas
    _close(whole, parameters)
    assert_resumes_bit_identically(spec, whole, checkpoint)
    # the host's masters and moments are also saved by name: a run that keeps them on the device resumes them
    on_device = run_local(spec.changed(offload_stages=(), resume_dir=checkpoint))
    assert on_device[0].losses == pytest.approx(whole[0].losses[2:], rel=1e-6)


def test_every_stage_offloaded_keeps_weights_and_gradients_only():
    schedule = build_schedule("interleaved", 2, 4, num_chunks=2)
    spec = TrainSpec(schedule, config=CONFIG, steps=3, dtype="bf16", offload_stages=(0, 1, 2, 3))
    results = run_local(spec)
    losses, _ = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=2e-3)
    for result in results:
        count = sum(v.numel() for stage in result.parameters.values() for v in stage.values())
        assert result.static_bytes == {"weights": 2 * count, "gradients": 4 * count, "optimizer": 0, "host": 16 * count}
        assert result.static_bytes == result.planned_static_bytes


def test_bad_zero_levels_are_refused():
    with pytest.raises(ConfigError, match="ZeRO level must be 0, 1 or 2"):
        check_spec(TrainSpec(build_schedule("1f1b", 2, 4), config=CONFIG, zero=3))
    with pytest.raises(ConfigError, match="ZeRO keeps only a shard"):
        check_spec(TrainSpec(build_schedule("1f1b", 2, 4), config=CONFIG, zero=2, record_gradients=True))
