"""The training step reads the device on the host once (its loss, with the optimizer's decisions),
plus once per MoE layer call under expert parallelism (an uneven all-to-all's split sizes).

Every way a tensor's value reaches Python (`item`, `tolist`, `cpu`, `bool(t)`, `float(t)`) is
counted from a step's start (`RankRun.begin_step`) to its booking (`RankRun.end_step`) on each
forked rank; the patches are made before the ranks fork, so they run in them."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.rank import RankRun  # noqa: E402
from pipeloom.runtime.training import TrainSpec  # noqa: E402

pytestmark = pytest.mark.slow

READS = ("item", "tolist", "cpu", "__bool__", "__float__")
CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


@pytest.fixture
def host_reads(monkeypatch):
    """Counts host reads per step into each step's record (`host_reads`)."""
    counter = {"on": False, "reads": 0}
    for name in READS:
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, **kwargs):
            if counter["on"]:
                counter["reads"] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    begin, end = RankRun.begin_step, RankRun.end_step

    def begin_step(self, step):
        counter.update(on=True, reads=0)
        return begin(self, step)

    def end_step(self, step, record, loss):
        counter["on"] = False
        record.host_reads = counter["reads"]
        return end(self, step, record, loss)

    monkeypatch.setattr(RankRun, "begin_step", begin_step)
    monkeypatch.setattr(RankRun, "end_step", end_step)


@pytest.mark.parametrize(
    "schedule, post_validation", [("1f1b", False), ("zb-v", False), ("dualpipev", False), ("zb-v", True)]
)
def test_a_clipped_step_reads_the_device_once(host_reads, schedule, post_validation):
    build = build_schedule(schedule, 2, 4)
    spec = TrainSpec(build, config=CONFIG, steps=2, clip_norm=0.5, post_validation=post_validation)
    for result in run_local(spec):
        assert [record.host_reads for record in result.records] == [1, 1]
        # and the decisions left nothing behind on the device beside the weights' static bytes
        assert result.held_bytes["parameters"] == sum(result.planned_static_bytes.values())


def test_expert_parallelism_adds_one_read_per_moe_layer_call(host_reads, tmp_path):
    from pipeloom.models.hf import hf_workload

    (tmp_path / "config.json").write_text(json.dumps(TINY["mixtral"]))
    work = hf_workload(tmp_path, seed=1, microbatch_size=2, seq_len=16)
    schedule = build_schedule("dualpipev", 2, 4)
    spec = TrainSpec(schedule, workload=work, steps=2, dp=2, ep=2)  # --ep refuses --clip-norm (issue 57)
    layers_per_stage = TINY["mixtral"]["num_hidden_layers"] // schedule.num_stages
    calls = schedule.num_microbatches * layers_per_stage * 2  # every rank hosts two stages of the V
    for result in run_local(spec):
        assert [record.host_reads for record in result.records] == [1 + calls, 1 + calls]
