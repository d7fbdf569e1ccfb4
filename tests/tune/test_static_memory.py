"""Static memory per measure (ZeRO-0/1/2, offload), and the tuner taking a measure only when needed."""

import dataclasses
import json

import pytest

from pipeloom.cli import main
from pipeloom.errors import InfeasibleError
from pipeloom.static_memory import collective_bytes, offload_saving, static_bytes
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.plan import Plan, plan_from_evaluation
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import tune

GIB = 2**30


def test_bytes_per_weight_follow_the_table():
    assert static_bytes(100).to_dict() == {
        "weights": 400,
        "gradients": 400,
        "optimizer": 800,
        "device": 1600,
        "host": 0,
    }
    one, two = static_bytes(100, dp=4, zero=1), static_bytes(100, dp=4, zero=2)
    assert (one.weights, one.gradients, one.optimizer) == (200, 400, 300)  # 2 + 4 + 12/dp in bf16
    assert (two.weights, two.gradients, two.optimizer) == (200, 200 + 100, 300)  # 2 + (2 + 4/dp) + 12/dp
    assert static_bytes(100, dp=4, zero=1, compute=4).weights == 400  # fp32 compute keeps 4-byte weights
    off = static_bytes(100, offloaded=True)
    assert (off.device, off.host) == (600, 1600)
    padded = static_bytes(10, dp=4, zero=2, padded=True)  # shards of ceil(10 / 4) = 3
    assert padded.optimizer == 12 * 3 and padded.gradients == 2 * 12 + 4 * 3 and padded.weights == 2 * 12
    assert offload_saving(100) == 1600 - 600 and offload_saving(100, dp=8, zero=1) == 750 - 600
    assert collective_bytes(100, 1, 0) == 0
    assert collective_bytes(100, 4, 0) == 2 * 0.75 * 400  # the all-reduce of fp32 gradients
    assert collective_bytes(100, 4, 1) == collective_bytes(100, 4, 2) == 0.75 * 400 + 0.75 * 200  # + all-gather


def _model(layers: int) -> AnalyticCostModel:
    return AnalyticCostModel(dataclasses.replace(load_model("gpt3-13b"), layers=layers), load_hardware("a100-40g"))


def _device_static(evaluation, cost_model) -> list[float]:
    """What `static_memory` says every device of the plan holds."""
    candidate = evaluation.candidate
    params = cost_model.stage_params(evaluation.partition)
    offloaded = "offload-all" in candidate.passes
    return [
        sum(static_bytes(params[s], candidate.dp, candidate.zero, offloaded).device for s in stages)
        for stages in ([range(d, len(params), candidate.pp)] for d in range(candidate.pp))
        for stages in stages
    ]


@pytest.mark.parametrize(
    "layers, pp, zero, offload, mario",
    [
        (32, 16, 0, False, False),  # dp = 1: nothing to shard, and it fits
        (32, 4, 1, False, False),  # dp = 4: ZeRO-1's 1/dp optimizer step for the same traffic is faster
        (128, 4, 2, False, True),  # static memory short: ZeRO-2 and recomputation
        (160, 4, 0, True, True),  # shorter still: every stage's optimizer on the host
    ],
)
def test_the_tuner_takes_a_static_measure_only_when_memory_is_short_or_it_is_faster(layers, pp, zero, offload, mario):
    cost_model = _model(layers)
    space = dict(schemes=["1f1b"], pp_values=[pp], micro_batches=[1], keep=1)
    best = tune(cost_model, 16, 40 * GIB, 64, layouts=False, **space).best  # the measure, on one layout
    assert (best.candidate.zero, "offload-all" in best.candidate.passes) == (zero, offload)
    assert ("mario" in best.candidate.passes) == mario
    assert best.static_memory == pytest.approx(_device_static(best, cost_model))
    assert max(best.peak_memory) <= 40 * GIB
    if zero or offload:  # without the measure the same space does not fit, or only slower
        try:
            plain = tune(cost_model, 16, 40 * GIB, 64, static_measures=False, **space).best
        except InfeasibleError:
            return
        assert plain.step_time > best.step_time


def test_a_plan_carries_its_measures_to_the_runtime(tmp_path):
    cost_model = _model(160)
    result = tune(cost_model, 16, 40 * GIB, 64, schemes=["1f1b"], pp_values=[4], micro_batches=[1], keep=1)
    plan = plan_from_evaluation(result.best, result, cost_model.model, cost_model.to_dict())
    plan.save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert loaded.offload_stages == (0, 1, 2, 3) and loaded.zero == 0
    older = {k: v for k, v in json.loads((tmp_path / "plan.json").read_text()).items() if k != "zero"}
    assert Plan.from_dict(older).zero == 0  # plans written before ZeRO load as ZeRO-0


def test_explain_names_the_measure_and_its_price(capsys, tmp_path):
    argv = ["tune", "--model", "gpt3-13b", "--hardware", "a100-40g", "--devices", "16", "--global-batch", "64"]
    argv += ["--schemes", "1f1b", "--pp", "4", "--max-mbs", "1", "--output", str(tmp_path / "plan.json"), "--explain"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("static memory:"))
    zero = json.loads((tmp_path / "plan.json").read_text())["zero"]
    assert zero > 0 and f"ZeRO-{zero}" in line and "GiB per device" in line and "ms per step" in line


def test_offloaded_optimizer_state_must_fit_the_host():
    cost_model = _model(160)
    space = dict(schemes=["1f1b"], pp_values=[4], micro_batches=[1], keep=1, layouts=False)
    best = tune(cost_model, 16, 40 * GIB, 64, **space).best
    assert "offload-all" in best.candidate.passes
    params = cost_model.stage_params(best.partition)
    assert best.host_memory == pytest.approx([static_bytes(n, offloaded=True).host for n in params])
    assert best.host_memory[0] == pytest.approx(16 * params[0])  # fp32 master weights, gradients, 2 moments
    with pytest.raises(
        InfeasibleError,
        match="offloading optimizer state to the host would need at least .* GiB of host memory per device",
    ):
        tune(cost_model, 16, 40 * GIB, 64, host_memory=0.5 * max(best.host_memory), **space)
    roomy = tune(cost_model, 16, 40 * GIB, 64, host_memory=max(best.host_memory), **space).best
    assert roomy.candidate == best.candidate


def test_tune_prints_host_memory_and_takes_host_memory(capsys, tmp_path):
    argv = ["tune", "--model", "gpt3-13b", "--hardware", "a100-40g", "--devices", "16", "--global-batch", "64"]
    argv += ["--schemes", "1f1b", "--pp", "4", "--max-mbs", "1", "--output", str(tmp_path / "plan.json")]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "(host 128 GiB each)" in out and "host GiB" in out  # a DGX A100's 1 TiB over 8 GPUs
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["predicted"]["host_memory"] == [0.0] * 4
    assert main(argv + ["--host-memory", "lots", "--force"]) == 2
    assert "memory budget 'lots'" in capsys.readouterr().err


def test_the_host_limit_also_binds_tpipe_s_offload_pass():
    cost_model = _model(340)
    space = dict(schemes=["tpipe"], pp_values=[16], micro_batches=[1], keep=1, layouts=False, static_measures=False)
    with pytest.raises(InfeasibleError) as unlimited:
        tune(cost_model, 16, 40 * GIB, 64, **space)
    assert "host memory" not in str(unlimited.value)
    with pytest.raises(InfeasibleError, match=r"to the host would need at least \d+\.\d+ GiB .* over the 10\.00 GiB"):
        tune(cost_model, 16, 40 * GIB, 64, host_memory=10 * GIB, **space)


@dataclasses.dataclass(frozen=True)
class _Drifting(AnalyticCostModel):
    """Replicas whose pipelines end 5 % apart."""

    def replica_skew(self, dp: int, zero: int = 0) -> float:
        return 0.05 if dp > 1 else 0.0


def test_the_replicas_wait_is_priced_in_the_sync_phase_at_every_zero_level():
    """The faster replica waits at the first collective after its pipeline — ZeRO-0's all-reduce,
    ZeRO-1/2's reduce-scatter — which the runtime times in its sync phase, not the optimizer's."""
    space = dict(schemes=["1f1b"], pp_values=[4], micro_batches=[1], keep=1)
    plain = _model(32)
    drifting = _Drifting(plain.model, plain.hardware)
    for limits in ({}, {"static_measures": False}):
        steady, waiting = (tune(model, 16, 40 * GIB, 64, **space, **limits).best for model in (plain, drifting))
        assert waiting.candidate == steady.candidate and waiting.candidate.dp == 4
        assert waiting.candidate.zero == (0 if limits else 1)
        assert waiting.optimizer_time == pytest.approx(steady.optimizer_time)
        assert waiting.allreduce_time == pytest.approx(steady.allreduce_time + 0.05 * waiting.pipeline_time)


def test_zero_s_weight_all_gather_is_priced_in_the_optimizer_phase_where_the_runtime_runs_it():
    cost_model = _model(32)
    best = tune(cost_model, 16, 40 * GIB, 64, schemes=["1f1b"], pp_values=[4], micro_batches=[1], keep=1).best
    assert best.candidate.zero == 1 and best.candidate.dp == 4
    params = max(cost_model.stage_params(best.partition))
    gather = cost_model.gather_time(params, 4, 4)
    assert gather > 0
    assert best.optimizer_time == pytest.approx(cost_model.optimizer_time(params, 4, zero=1) + gather)
    assert best.allreduce_time == pytest.approx(cost_model.allreduce_time(params, 4, 4, zero=1) - gather)
    assert cost_model.gather_time(params, 4, 1) == 0.0
