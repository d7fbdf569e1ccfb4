"""Every feature under every layout, against one process: a loss-and-gradient parity matrix.

Rows are features (plain, clipping, bf16, fp16 with its loss scale, ZeRO-1/2, host offload,
save + resume, evaluation), columns layouts (pp2 1f1b, pp2 zb-v, pp2 × dp2, pp2 × tp2 with and
without sequence parallelism, pp1 × tp2 × dp2, pp2 × cp2 under 1f1b, zb-h1 and zb-v, pp1 × cp2 ×
tp2, Mistral under pp2 × cp2, and a mixture of experts under pp2 × dp2 × ep2 (1f1b, dualpipev),
pp1 × tp2 × dp2 × ep2 and pp1 × cp2 × ep2 (its experts shared over the cp ranks)). The cells cover every row and every column, each
feature under a dense and an expert-parallel layout, not the whole product; which cells other
tests cover is in docs/runtime.md ("Every feature under every layout").

A cell trains three steps of real text (`examples/train.bin`'s bytes) at AdamW lr 1e-2 and
compares what a wrong sum over a group would change even where AdamW's normalised update hides it:
each step's loss and global gradient norm (rtol 1e-5 in fp32: the same kernels, sums in another
order — row-parallel products, tokens routed to experts, buckets over replicas), the last step's
gradients where the layout keeps them whole (`record_gradients`; ZeRO keeps a shard), and the
weights (`assert_weights_close`). A rounding difference δ in a near-zero gradient moves a weight
by up to lr·δ/(δ + 1e-8) a step; those drifts reach the last step's gradients as differences well
under their atol of 1e-6, while a doubled or missing sum moves a gradient by its own size (1e-4 to
1e-2 here). In bf16 and fp16 each operand of a GEMM is rounded to 8 or 11 significant bits, in
another order on each side: losses and norms to 2e-2.
Runs fork ranks only where the transport matters (ZeRO, clipping, checkpoints, tp, ep); the
rest run in this process.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.distributed.checkpoint as dcp  # noqa: E402
from helpers.hf_configs import TINY  # noqa: E402
from helpers.runtime import assert_gradients_close, assert_resumes_bit_identically, saved_midway  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.costs import Costs  # noqa: E402
from pipeloom.data import TokenFile  # noqa: E402
from pipeloom.models.hf import hf_workload  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

SEQ, STEPS, LR = 16, 3, 1e-2
TEXT = "examples/train.bin"  # bytes of English text: skewed routing, a vocabulary of 256


@dataclass(frozen=True)
class Layout:
    schedule: str
    p: int
    model: str = "llama"
    parallel: dict = field(default_factory=dict)
    batch: int = 4
    """Micro-batches a step, over the replicas (fewer under tp: each costs a forked rank its collectives)."""
    layers: int | None = None
    """Decoder layers (None: one a stage, at least two)."""

    def spec(self, directory, **changes) -> TrainSpec:
        options = {"costs": Costs(F=1.0, B=1.0, W=1.0, a2a_F=1.0, a2a_B=1.0)} if self.schedule == "dualpipev" else {}
        m = self.batch // self.parallel.get("dp", 1)
        schedule = build_schedule(self.schedule, self.p, m, **options)
        layers = self.layers or max(2, schedule.num_stages)  # a layer a stage: collectives cost a forked rank most
        config = {**TINY[self.model], "vocab_size": 256, "num_hidden_layers": layers}
        path = directory / f"{self.model}-{layers}"
        path.mkdir(exist_ok=True)
        (path / "config.json").write_text(json.dumps(config))
        work = hf_workload(path, seed=1, microbatch_size=2, seq_len=SEQ, data=TokenFile(TEXT, SEQ, seed=2))
        return TrainSpec(schedule, workload=work, **{"steps": STEPS, "lr": LR, **self.parallel, **changes})


LAYOUTS = {
    "pp2-1f1b": Layout("1f1b", 2),
    "pp2-zb-v": Layout("zb-v", 2),
    "pp2xdp2": Layout("1f1b", 2, parallel=dict(dp=2)),
    "pp2xtp2": Layout("zb-h1", 2, parallel=dict(tp=2), batch=2),
    "pp2xtp2+sp": Layout("1f1b", 2, parallel=dict(tp=2, sequence_parallel=True), batch=2),
    "pp1xtp2xdp2": Layout("1f1b", 1, parallel=dict(tp=2, dp=2)),
    "pp2xcp2-1f1b": Layout("1f1b", 2, parallel=dict(cp=2)),
    "pp2xcp2-zb-h1": Layout("zb-h1", 2, parallel=dict(cp=2)),
    "pp2xcp2-zb-v": Layout("zb-v", 2, parallel=dict(cp=2)),
    "pp1xcp2xtp2+sp": Layout("1f1b", 1, parallel=dict(cp=2, tp=2, sequence_parallel=True), batch=2),
    "mistral-pp2xcp2": Layout("1f1b", 2, "mistral", dict(cp=2)),
    "moe-pp1xcp2xep2": Layout("1f1b", 1, "qwen2_moe", dict(cp=2, ep=2)),  # experts over the cp ranks
    "moe-pp2xdp2xep2-1f1b": Layout("1f1b", 2, "mixtral", dict(dp=2, ep=2)),
    "moe-pp2xdp2xep2-dualpipev": Layout("dualpipev", 2, "mixtral", dict(dp=2, ep=2), batch=8),
    "moe-pp1xtp2xdp2xep2": Layout("1f1b", 1, "mixtral", dict(tp=2, dp=2, ep=2)),
}
ROWS = {
    "plain": {},
    "clip": dict(clip_norm=0.5),
    "bf16": dict(dtype="bf16"),
    "fp16": dict(dtype="fp16", clip_norm=0.5),
    "zero1": dict(zero=1, clip_norm=0.5),
    "zero2": dict(zero=2, clip_norm=0.5),
    "offload": dict(offload_stages=(0,), clip_norm=0.5),
    "zero1+offload": dict(zero=1, offload_stages=(0,), clip_norm=0.5),
    "fp16+offload": dict(dtype="fp16", offload_stages=(1,), post_validation=True, clip_norm=0.5),
}
CELLS = [
    ("plain", "pp2-1f1b"),
    ("plain", "pp2-zb-v"),
    ("bf16", "pp2-zb-v"),
    ("plain", "pp2xdp2"),
    ("zero1", "pp2xdp2"),
    ("clip", "pp2xtp2"),
    ("fp16", "pp2xtp2"),
    ("fp16+offload", "pp2xdp2"),
    ("offload", "pp2xtp2+sp"),
    ("zero2", "pp1xtp2xdp2"),
    ("bf16", "pp1xtp2xdp2"),
    ("plain", "pp2xcp2-1f1b"),
    ("zero1", "pp2xcp2-1f1b"),
    ("clip", "pp2xcp2-zb-h1"),
    ("plain", "pp2xcp2-zb-v"),
    ("clip", "pp1xcp2xtp2+sp"),
    ("plain", "mistral-pp2xcp2"),
    ("plain", "moe-pp1xcp2xep2"),
    ("zero1", "moe-pp2xdp2xep2-1f1b"),
    ("offload", "moe-pp2xdp2xep2-1f1b"),
    ("zero2", "moe-pp2xdp2xep2-dualpipev"),
    ("fp16", "moe-pp2xdp2xep2-dualpipev"),
    ("clip", "moe-pp1xtp2xdp2xep2"),
    ("zero1+offload", "moe-pp1xtp2xdp2xep2"),
]


def _in_process_allowed(spec: TrainSpec) -> bool:
    from pipeloom.runtime.in_process import _check_in_process

    try:
        _check_in_process(spec)
    except Exception:  # noqa: BLE001
        return False
    return spec.ep == 1


@pytest.mark.parametrize("row, column", CELLS, ids=[f"{row}-{column}" for row, column in CELLS])
def test_every_cell_trains_like_one_process(tmp_path, row, column):
    changes = dict(ROWS[row])
    keeps_whole = changes.get("zero", 0) == 0
    spec = LAYOUTS[column].spec(tmp_path, record_gradients=keeps_whole, **changes)
    results = run_in_process(spec) if _in_process_allowed(spec) else run_local(spec)
    gradients: list = []
    norms: list = []
    losses, expected = reference_training(spec, gradients, norms)
    low_precision = spec.dtype != "fp32"
    rtol = 2e-2 if low_precision else 1e-5
    assert results[0].losses == pytest.approx(losses, rel=rtol)
    if spec.clip_norm is not None:
        assert norms[0] > spec.clip_norm  # the first step clips
        for result in results:
            assert result.grad_norms == pytest.approx(norms, rel=rtol)
    if keeps_whole and not low_precision:  # the last step's, after the weights drifted apart by rounding
        assert_gradients_close(results, gradients, atol=1e-6)
    for result in results:
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                assert_weights_close(value, expected[stage][name], low_precision, name)
    assert_every_weight_counted_once(spec, results)


def assert_every_weight_counted_once(spec: TrainSpec, results) -> None:
    """The placements the ranks report: one replica's ranks count each dense weight's elements
    exactly once in the global norm, and the expert-parallel group's (whose slices it sums) each
    expert's — whatever cut them."""
    layout, ep = spec.parallelism.layout, spec.ep
    counted: dict[str, int] = {}
    whole: dict[str, int] = {}
    for result in results:
        replica = layout.coords(result.rank)[0]
        for record in result.placements:
            whole[record.name] = math.prod(record.shape)
            if replica == 0 or (record.expert and replica < ep):
                counted[record.name] = counted.get(record.name, 0) + record.counted_numel
    assert whole and counted == whole


def assert_weights_close(value, expected, low_precision: bool, name: str) -> None:
    """AdamW moves a weight by about lr a step whatever its gradient's size, so a gradient
    within rounding of zero that flips its sign moves it by up to 2·lr a step: each weight within
    2·lr·steps. In fp32 such flips are rare — all but one weight in a thousand within lr·steps·1e-3
    (rtol 1e-5); in bf16 or fp16, where every operand is rounded, any weight may flip."""
    bound = 2 * LR * STEPS
    difference = (value - expected).abs()
    assert float(difference.max()) <= bound, f"{name}: {float(difference.max())} > {bound}"
    if not low_precision:
        tight = difference <= LR * STEPS * 1e-3 + 1e-5 * expected.abs()
        assert int((~tight).sum()) <= max(1, value.numel() // 1000), f"{name}: {int((~tight).sum())} weights apart"


RESUMES = [  # (layout, features, other layouts and features it resumes under)
    (  # ZeRO-1's shards and the host's state of a tp shard, read into whole weights, other shards, other stages
        "pp2xtp2",
        dict(zero=1, offload_stages=(1,), clip_norm=0.5),
        [dict(tp=1, zero=2, dp=2), dict(p=1, tp=1, zero=0, offload_stages=(0,)), dict(p=1, zero=0, offload_stages=())],
    ),
    ("moe-pp2xdp2xep2-1f1b", dict(zero=2, clip_norm=0.5), [dict(ep=1, zero=0, offload_stages=(0,))]),
    ("pp2xcp2-1f1b", dict(zero=1, clip_norm=0.5), [dict(cp=1, zero=0)]),  # the cp ranks' shards, read whole
]


@pytest.mark.parametrize("column, changes, elsewhere", RESUMES, ids=[column for column, *_ in RESUMES])
def test_save_and_resume_continue_bit_identically(tmp_path, column, changes, elsewhere):
    """Each tp or ep shard is saved as a part of one tensor, the whole weight under its name. The
    run resumes on the same layout bit for bit; under another (pp, tp, dp, ep, ZeRO level, offload
    set: each weight and its optimizer state read by name and cut anew) within rounding of the
    sums. A resume keeps the batch: its micro-batches over the replicas."""
    layout = LAYOUTS[column]
    spec = layout.spec(tmp_path, **changes, steps=4)
    whole, checkpoint = saved_midway(spec, tmp_path / "ckpt")
    stored = dcp.FileSystemReader(checkpoint).read_metadata().state_dict_metadata
    shapes = {record.name: tuple(record.shape) for result in whole for record in result.placements}
    saved = {key.removeprefix("model."): tuple(entry.size) for key, entry in stored.items() if key.startswith("model.")}
    assert saved == shapes  # each tp or ep shard saved as a part of one tensor: the whole weight, by name
    assert_resumes_bit_identically(spec, whole, checkpoint)
    for other in elsewhere:
        flat = {key: value for key, value in other.items() if key != "p"}
        moved = replace(layout, p=other.get("p", layout.p), parallel={**layout.parallel, **flat})
        resumed = run_local(moved.spec(tmp_path, **{**changes, **flat}, steps=4, resume_dir=checkpoint))
        assert resumed[0].losses == pytest.approx(whole[0].losses[2:], rel=1e-6), other


EVALUATED = ["pp2xdp2", "moe-pp1xtp2xdp2xep2", "pp2xcp2-zb-v"]


@pytest.mark.parametrize("column", EVALUATED)
def test_evaluation_equals_one_process(tmp_path, column):
    """The held-out loss after each step is the one a single device computes with the same weights."""
    held_out = TokenFile(TEXT, SEQ, seed=9).batch
    changes = dict(eval_data=held_out, eval_every=1, eval_batches=2)
    layout = LAYOUTS[column]
    spec = layout.spec(tmp_path, **changes)
    results = run_in_process(spec) if _in_process_allowed(spec) else run_local(spec)
    layers = spec.resolved_workload().check(spec.schedule.num_stages)  # the same model, on one device
    one = replace(layout, schedule="1f1b", p=1, parallel={}, layers=sum(layers)).spec(tmp_path, **changes)
    alone = run_in_process(replace(one, schedule=build_schedule("1f1b", 1, 4)))
    assert [step for step, _ in results[0].eval_losses] == [1, 2, 3]
    got = [loss for _, loss in results[0].eval_losses]
    assert got == pytest.approx([loss for _, loss in alone[0].eval_losses], rel=1e-5)
    assert all(math.isfinite(loss) for loss in got)
