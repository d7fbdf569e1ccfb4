"""What the runtime tests share: the tiny decoder, the single-process reference (computed once
per model, data and step count, then reused by every schedule that trains it) and the check that
a pipeline trained exactly like it.

Tolerances follow from the arithmetic: a pipeline runs the reference's kernels on the same
tensors, but fp32 sums (a gradient over micro-batches, tied weights over both ends) may add in
another order, and AdamW's normalised update turns an ulp in a near-zero gradient into up to
lr × 1e-3 of a weight each step (`update_tolerance`); slice by slice, attention itself sums in
another order.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeloom.models.llama import LlamaConfig
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.local import run_local
from pipeloom.runtime.training import TrainSpec, reference_training

TINY_LLAMA = dict(hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)

_references: dict[tuple, tuple[list[float], list[dict[str, torch.Tensor]]]] = {}


def tiny_spec(schedule, **changes) -> TrainSpec:
    """The built-in decoder, at least as many layers as the schedule has stages."""
    config = LlamaConfig(layers=max(4, schedule.num_stages), **TINY_LLAMA)
    return TrainSpec(schedule, config=config, **changes)


def reference(spec: TrainSpec):
    """`reference_training(spec)`, cached for the built-in decoder (what it depends on is the key)."""
    if spec.workload is not None:
        return reference_training(spec)
    s = spec.schedule
    key = (spec.config, spec.seed, spec.layer_counts, s.num_stages, s.num_microbatches * spec.dp)
    key += (spec.steps, spec.lr, spec.dtype, spec.threads, spec.clip_norm)
    if key not in _references:
        _references[key] = reference_training(spec)
    return _references[key]


def update_tolerance(spec: TrainSpec) -> float:
    """What AdamW's normalised updates may move a weight by when a gradient's ulp differs: up to
    lr × 1e-3 a step, every step of the run."""
    return spec.steps * spec.lr * 1e-3


def assert_matches_reference(spec: TrainSpec, results, rtol: float | None = None, atol: float | None = None):
    """Every rank's parameters after training, and the losses, as one process gives them."""
    losses, expected = reference(spec)
    sliced = spec.schedule.num_slices > 1
    rtol = rtol if rtol is not None else (1e-4 if sliced else 1e-5)
    atol = atol if atol is not None else (5e-5 if sliced else update_tolerance(spec))
    assert results[0].losses == pytest.approx(losses, rel=rtol)
    for result in results:
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                torch.testing.assert_close(value, expected[stage][name], rtol=rtol, atol=atol, msg=f"{stage} {name}")
    return results


def trains_like_one_process(spec: TrainSpec, rtol: float | None = None, atol: float | None = None):
    """Run `spec` with every device in this process and check it against the reference."""
    return assert_matches_reference(spec, run_in_process(spec), rtol, atol)


def assert_same_results(one, other) -> None:
    """Two runs of one spec gave the same losses and bit-identical parameters on every rank."""
    assert [r.losses for r in one] == [r.losses for r in other]
    assert_same_weights(one, other)


def saved_midway(spec: TrainSpec, directory) -> tuple[list, str]:
    """Train `spec` with forked ranks, saving after half its steps (and at its end): its results and
    the midway checkpoint — the run a resume must continue, interrupted where it saved."""
    half = spec.steps // 2
    results = run_local(spec.changed(save_every=half, save_dir=str(directory)))
    return results, str(Path(directory) / f"step-{half}")


def assert_resumes_bit_identically(spec: TrainSpec, whole, checkpoint: str) -> list:
    """`spec` resumed from `checkpoint` on the layout that saved it gives the rest of `whole`'s
    losses and, on every rank, its weights bit for bit; the resumed run's results."""
    resumed = run_local(spec.changed(resume_dir=checkpoint))
    assert resumed[0].losses == whole[0].losses[len(whole[0].losses) - len(resumed[0].losses) :]
    assert len(resumed[0].losses) < len(whole[0].losses)
    assert_same_weights(whole, resumed)
    return resumed


def assert_same_weights(one, other) -> None:
    """Bit-identical parameters on every rank."""
    for a, b in zip(one, other, strict=True):
        assert a.parameters.keys() == b.parameters.keys()
        for stage in a.parameters:
            for name, value in a.parameters[stage].items():
                assert torch.equal(value, b.parameters[stage][name]), (a.rank, stage, name)


def assert_gradients_close(results, expected: list[dict[str, torch.Tensor]], atol: float | None = None) -> None:
    """Every rank's recorded gradients against one process's, to fp32 rounding of sums taken in
    another order (row-parallel products, tokens routed to experts): rtol 1e-5, and 1e-5 of each
    tensor's largest entry for entries that nearly cancel — or `atol`, for gradients taken after
    steps whose weights already drifted apart by rounding."""
    for result in results:
        for stage, gradients in result.gradients.items():
            for name, value in gradients.items():
                bound = atol if atol is not None else 1e-5 * float(expected[stage][name].abs().max())
                torch.testing.assert_close(
                    value, expected[stage][name], rtol=1e-5, atol=bound, msg=lambda m, name=name: f"{name}: {m}"
                )
