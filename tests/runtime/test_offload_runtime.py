"""T-Offload in the runtime: deep stages stepped on the host, weights reloaded, results unchanged."""

import pytest

torch = pytest.importorskip("torch")

from pipeloom import build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.passes import t_offload  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def test_offloaded_stages_end_where_the_device_optimizer_would():
    schedule = build_schedule("tpipe", 2, 4)
    stages = t_offload(schedule).stages  # the deep chunk of each device
    assert stages == (2, 3)
    plain = run_in_process(TrainSpec(schedule, config=CONFIG, steps=3))  # the forked ranks' bits, one process
    offloaded = run_local(TrainSpec(schedule, config=CONFIG, steps=3, offload_stages=stages))
    assert offloaded[0].losses == plain[0].losses
    for rank, result in enumerate(offloaded):
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                assert torch.equal(value, plain[rank].parameters[stage][name]), (stage, name)
        names = [text for text, _, _ in result.offload_events]
        stage = stages[rank]
        assert names.count(f"{stage}OFFLOAD") == 3 and names.count(f"{stage}RELOAD") == 3
        assert names.count("HOST_STEP") == 3
        # each reload follows the host step of the previous step's gradients
        assert all(names.index(f"{stage}OFFLOAD") < names.index(f"{stage}RELOAD") for _ in range(1))


def test_quantized_reload_trains_close_to_exact():
    schedule = build_schedule("1f1b", 2, 4)
    spec = TrainSpec(schedule, config=CONFIG, steps=3, offload_stages=(1,), reload_bits=16)
    results = run_local(spec)
    losses, _ = reference_training(TrainSpec(schedule, config=CONFIG, steps=3))
    assert results[0].losses == pytest.approx(losses, rel=1e-2)
    assert results[0].losses != losses  # bfloat16 weights on the device: not bit-identical


def test_offloaded_stages_of_data_parallel_replicas_end_where_the_device_optimizer_would():
    """dp = 2 under ZeRO-0: the gradient buckets sum an offloaded stage's gradients out of its host
    store's buffer (which they leave to it), the rest in their own buffers, in place."""
    schedule = build_schedule("zb-h1", 2, 2)
    plain = run_in_process(TrainSpec(schedule, config=CONFIG, steps=2, dp=2))
    offloaded = run_local(TrainSpec(schedule, config=CONFIG, steps=2, dp=2, offload_stages=(1,)))
    assert offloaded[0].losses == plain[0].losses
    for rank, result in enumerate(offloaded):
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                assert torch.equal(value, plain[rank].parameters[stage][name]), (rank, stage, name)
