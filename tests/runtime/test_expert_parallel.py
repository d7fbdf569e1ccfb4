"""Expert parallelism: pp = 2 × dp = 2 gloo ranks with --ep 2 train mixture-of-experts models on a
token file like one process running the library's dense expert loop.

These fork ranks: the all-to-alls need a process group per rank. Each run is one small model,
three steps. With fp32 the two runs differ only in summation order (a gradient summed over the
replicas' tokens by the bucket all-reduce, not in one backward), so losses agree to rtol 1e-5;
parameters are compared at lr = 1e-5 for the reason `test_tensor_parallel` gives (AdamW turns a
rounding difference in a near-zero gradient into up to lr·δ/1e-8).
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from helpers.hf_configs import TINY  # noqa: E402
from helpers.runtime import (  # noqa: E402
    assert_gradients_close,
    assert_matches_reference,
)

from pipeloom import build_schedule  # noqa: E402
from pipeloom.costs import Costs  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.pair_baton import PairBaton, pass_baton  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

SEQ = 16
PRICED_A2A = Costs(F=1.0, B=1.0, W=1.0, a2a_F=1.0, a2a_B=1.0)
"""All-to-alls worth hiding: DualPipeV keeps its overlapped pairs (they are split without them)."""


def model_dir(tmp_path, family: str, **changes):
    directory = tmp_path / "-".join([family, *map(str, changes.values())])
    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps({**TINY[family], **changes}))
    return directory


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    from pipeloom.data import write_token_file

    ids = torch.randint(0, 96, (4000,), generator=torch.Generator().manual_seed(7))
    return write_token_file(tmp_path_factory.mktemp("tokens") / "tokens.bin", ids.numpy(), "uint16")


def moe_spec(tmp_path, token_file, family: str, schedule: str, lr: float = 1e-5, **changes) -> TrainSpec:
    from pipeloom.data import TokenFile

    options = {"costs": PRICED_A2A} if schedule == "dualpipev" else {}
    built = build_schedule(schedule, 2, 4 if schedule == "dualpipev" else 2, **options)  # DualPipeV: m ≥ 2p − 1
    layers = max(2, built.num_stages)  # a layer a stage: each layer's all-to-alls cost a forked rank most
    directory = model_dir(tmp_path, family, num_hidden_layers=layers)
    work = hf_workload(directory, seed=1, microbatch_size=2, seq_len=SEQ, data=TokenFile(token_file, SEQ, seed=2))
    return TrainSpec(built, workload=work, lr=lr, **{"dp": 2, "ep": 2, **changes})


@pytest.mark.parametrize(
    "family, schedule", [("mixtral", "1f1b"), ("qwen2_moe", "zb-h1"), ("mixtral", "dualpipev")], ids=str
)
def test_pp2_dp2_ep2_trains_like_one_process(tmp_path, token_file, family, schedule):
    spec = moe_spec(tmp_path, token_file, family, schedule)
    results = run_local(spec)
    assert len(results) == 4
    assert_matches_reference(spec, results, rtol=1e-5, atol=1e-6)  # expert weights gathered over the EP group
    layers = max(2, spec.schedule.num_stages) // spec.schedule.num_stages
    for result in results:
        record = result.records[-1]
        stages = len(result.parameters)
        # every (token, choice) of this replica's micro-batches routed once per MoE layer it hosts
        m = spec.schedule.num_microbatches
        assert sum(record.expert_tokens) == m * 2 * SEQ * 2 * layers * stages
        assert record.a2a_sent_bytes > 0 and 0.0 <= record.a2a_exposed_ms <= record.a2a_ms
        # what the rank's objects hold is its slice of the experts and the plan's bytes for it, no full copy
        assert result.held_bytes["parameters"] == sum(result.planned_static_bytes.values()) > 0
    if schedule == "dualpipev":  # the pairs ran by turns: both ops of a pair start together
        paired = [op for op in spec.schedule.devices[0] if op.overlap_next]
        assert paired, "the priced all-to-alls kept DualPipeV's pairs"
        starts = dict((text, start) for text, start, _ in results[0].records[-1].ops)
        index = spec.schedule.devices[0].index(paired[0])
        assert starts[paired[0].text] == starts[spec.schedule.devices[0][index + 1].text]


def test_expert_parallelism_survives_the_skewed_routing_of_real_text(tmp_path):
    """Byte tokens of English text route unevenly: within a few steps at lr 1e-2 some layer sends
    every token of the group past a rank's experts, which then receive no rows at all. That rank
    must still run the backward's reverse exchanges as its peers do (it used to leave its graph
    there and gloo failed on a mismatched collective); 20 steps equal one process."""
    from pipeloom.data import TokenFile

    text = Path(__file__).resolve().parents[2] / "examples" / "train.bin"
    directory = model_dir(tmp_path, "mixtral", vocab_size=256, max_position_embeddings=64)
    work = hf_workload(directory, seed=1, microbatch_size=2, seq_len=32, data=TokenFile(text, 32, seed=0))
    spec = TrainSpec(build_schedule("1f1b", 2, 4), workload=work, lr=1e-2, dp=2, ep=2, steps=20, record_gradients=True)
    results = run_local(spec)
    reference_gradients: list = []
    losses, _ = reference_training(spec, reference_gradients)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    assert_gradients_close(results, reference_gradients, atol=1e-6)  # the 20th step's, after 19 of rounding


def test_the_global_norm_under_ep_counts_every_expert_once(tmp_path, token_file):
    """Clipping, post-validation and the non-finite skip under pp2 × dp2 with ep 2: each rank's
    dense weights count within its replica (equal on both), its experts over its expert-parallel
    group (which holds the layer's experts between them), so the global norm is the same run's
    without expert parallelism; a NaN on one stage skips the step on every rank."""
    faults = ((1, 1, "nan", 0.0),)
    changes = dict(steps=3, clip_norm=0.05, lr=1e-3, gradient_faults=faults)
    whole = run_local(moe_spec(tmp_path, token_file, "mixtral", "1f1b", **{**changes, "ep": 1}))
    norms = whole[0].grad_norms
    assert len(norms) == 3 and norms[0] > 0.05 and norms[2] > 0.05  # clipping acts
    for post_validation in (False, True):
        shared = run_local(
            moe_spec(tmp_path, token_file, "mixtral", "1f1b", post_validation=post_validation, **changes)
        )
        assert shared[0].losses == pytest.approx(whole[0].losses, rel=1e-5)
        for result in shared:
            assert result.grad_norms == pytest.approx(norms, rel=1e-5, nan_ok=True)
            assert result.skipped_steps == 1


def test_the_cli_trains_dualpipev_with_expert_parallelism(tmp_path, token_file, capsys):
    from pipeloom.cli import main

    model = model_dir(tmp_path, "qwen3_moe")
    flags = ["--schedule", "dualpipev", "-p", "2", "--dp", "2", "--ep", "2", "-m", "4", "--steps", "2"]
    flags += ["--model", f"hf:{model}", "--data", str(token_file), "--seq-len", str(SEQ), "--quiet"]
    flags += ["--costs", "F=1,B=1,W=1,a2a_F=1,a2a_B=1"]
    summary = tmp_path / "summary.json"
    assert main(["train", "--nproc", "4", *flags, "--summary", str(summary)]) == 0
    out = capsys.readouterr().out
    assert "ep=2" in out and "a2a ms (hidden)" in out
    facts = json.loads(summary.read_text())
    for rank in facts["ranks"]:
        assert rank["a2a_sent_bytes_per_step"] > 0 and len(rank["expert_tokens_per_step"]) == 4
        assert rank["expert_load_imbalance"] >= 1.0
    refused = ["train", "--nproc", "4", "--schedule", "1f1b", "-p", "2", "--dp", "2", "-m", "4", "--ep", "3"]
    assert main([*refused, "--model", f"hf:{model}", "--seq-len", str(SEQ)]) == 2
    assert "--ep 3 does not divide --dp 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    "family, changes, message",
    [
        ("mixtral", {"ep": 3, "dp": 3}, "the model's 4 experts do not divide by --ep 3"),
        ("mixtral", {"ep": 2, "dp": 3}, "--ep 2 does not divide --dp 3"),
        ("llama", {"ep": 2, "dp": 2}, "no routed experts; --ep needs a mixture-of-experts model"),
    ],
)
def test_expert_parallelism_that_cannot_run_is_refused_in_one_line(tmp_path, family, changes, message):
    work = hf_workload(model_dir(tmp_path, family), microbatch_size=2, seq_len=SEQ)
    spec = TrainSpec(build_schedule("1f1b", 2, 4), workload=work, **changes)
    with pytest.raises(ConfigError, match=message):
        check_spec(spec)


def test_a_pair_switches_only_where_an_exchange_is_in_flight():
    """The two ops take turns at each switch; once one is done the other runs on alone."""
    order: list[str] = []

    def forward():
        order.append("F attention")
        assert pass_baton()  # dispatch in flight
        order.append("F experts")
        assert pass_baton()  # combine in flight
        order.append("F rest")
        assert not pass_baton()  # the backward has finished: nothing to switch to

    def backward():
        order.append("B head")
        assert pass_baton()
        order.append("B rest")

    PairBaton().run(forward, backward)
    assert order == ["F attention", "B head", "F experts", "B rest", "F rest"]
    assert not pass_baton()  # outside a pair


def test_the_baton_passes_from_a_backward_that_autograd_runs_on_another_thread():
    """On CUDA autograd runs a custom Function's backward on its device thread, not the caller's:
    an exchange there passes the baton as one on the op's own thread does."""
    order: list[str] = []

    class Exchange(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            order.append(f"B exchange on {threading.current_thread().name}")
            assert pass_baton() is not None  # the forward computes while it is in flight
            order.append("B rest")
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    loss = Exchange.apply(x).sum()

    def backward():  # autograd's own thread, forced
        worker = threading.Thread(target=loss.backward, name="autograd-device")
        worker.start()
        worker.join()

    def forward():
        order.append("F attention")
        assert pass_baton() is not None
        order.append("F rest")

    PairBaton().run(forward, backward)
    assert order == ["F attention", "B exchange on autograd-device", "F rest", "B rest"]
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


def test_an_exchange_counts_as_hidden_only_what_the_paired_op_ran_while_it_was_in_flight():
    from pipeloom.runtime.clocks import HostClock
    from pipeloom.runtime.expert_parallel import ExpertTraffic, _Flight
    from pipeloom.runtime.pair_baton import Turn

    traffic = ExpertTraffic()
    traffic.flights = [
        _Flight(0.0, 10.0, Turn(2.0, 6.0), backward=False),  # the partner ran 4 s of the 10
        _Flight(20.0, 30.0, Turn(28.0, 35.0), backward=True),  # it ran on after the exchange ended
        _Flight(40.0, 45.0, None, backward=True),  # no partner: all waited for
    ]
    traffic.settle(HostClock())
    assert traffic.flight_s == 25.0 and traffic.forward_flight_s == 10.0 and traffic.overlapped_flight_s == 20.0
    assert traffic.exposed_s == (10 - 4) + (10 - 2) + 5 and traffic.flights == []


def test_the_profile_measures_the_ops_apart_from_their_exchanges_with_the_experts_shared_out(tmp_path):
    """`layouts.measure_layout` of `Layout(ep=2)`: one stage over two replicas sharing out its
    experts, each op's compute fitted apart from the all-to-alls in flight in it (`a2a_F`,
    `a2a_B`), the stash as it is there — on real text (`profile --data`), whose skewed routing
    fills one replica's experts more than the other's: the stash fitted is the fuller one's, which
    a plan's device peaks at — and the replicas' wait on such replicas."""
    from pipeloom.data import TokenFile
    from pipeloom.profile.layouts import measure_layout, replica_waits
    from pipeloom.profile.probe_rounds import ProbeModel, Turns
    from pipeloom.profile_format import Layout

    directory = model_dir(tmp_path, "mixtral", vocab_size=256)  # a byte a token
    text = TokenFile(Path(__file__).resolve().parents[2] / "examples" / "train.bin", SEQ, seed=0)
    workload_for = lambda n, mbs: hf_workload(directory, 0, mbs, SEQ, layers=n, data=text)  # noqa: E731
    probed = ProbeModel(None, steps=1, workload_for=workload_for)
    measured, probes = measure_layout(Layout(ep=2), probed, (1,), (1, 2), Turns().fixed(1))
    fits = measured.fits[1]
    assert {"F", "B", "W", "R", "M_B", "M_W", "a2a_F", "a2a_B"} <= fits.keys()
    assert fits["a2a_F"].per_layer + fits["a2a_F"].single > 0 and fits["M_B"].per_layer > 0
    fuller = {n: max(probe.median("M_B@0"), probe.median("M_B@1")) for (_, n), probe in probes.items()}
    assert any(probe.median("M_B@0") != probe.median("M_B@1") for probe in probes.values())  # routed unevenly
    assert [n * fits["M_B"].per_layer + fits["M_B"].single for n in (1, 2)] == pytest.approx([fuller[1], fuller[2]])
    assert all(probe.median("a2a_F@0") > 0 for probe in probes.values())
    waits = replica_waits(Layout(ep=2), probed, 1, 1, Turns().fixed(1))
    assert list(waits) == [0] and waits[0].pipeline_ms > 0 and waits[0].layers == 1
    assert 0 <= waits[0].skew_ms < waits[0].pipeline_ms  # the two replicas' pipelines, measured
