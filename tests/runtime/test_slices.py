"""Slices and weight-gradient parts in the runtime (MEPipe §4–5, TeraPipe): same training as one
process (every device in this process)."""

import pytest

torch = pytest.importorskip("torch")

from pipeloom import Costs, build_schedule, simulate  # noqa: E402
from pipeloom.models.llama import LlamaConfig, build_stages  # noqa: E402
from pipeloom.passes import apply_checkpoint, overlap_recompute, weight_parts  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.training import TrainSpec, reference_training  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def assert_trains_like_one_process(schedule, steps=2):
    """Slice by slice, attention sums in another order, so gradients differ by fp32 rounding of
    their terms. AdamW divides each gradient by its own size, so a rounding difference in a
    gradient element near zero (3e-8 ± 8e-9 here) moves its weight by a sizeable part of lr:
    weights agree to lr per step."""
    spec = TrainSpec(schedule, config=CONFIG, steps=steps)
    results = run_in_process(spec)
    losses, reference = reference_training(spec)
    assert results[0].losses == pytest.approx(losses, rel=1e-5)
    for result in results:
        for stage, parameters in result.parameters.items():
            for name, value in parameters.items():
                torch.testing.assert_close(value, reference[stage][name], rtol=1e-4, atol=spec.lr * steps)
    return results


def test_slice_by_slice_attention_equals_the_whole_sequence():
    stage = build_stages(CONFIG, 1, seed=0)[0]
    tokens = torch.randint(0, CONFIG.vocab, (2, CONFIG.seq_len))
    outputs, past = [], []
    for index in range(4):
        out, kv = stage.forward_slice(tokens[:, 4 * index : 4 * index + 4], past)
        outputs.append(out)
        past = [(torch.cat((pk, k), -2), torch.cat((pv, v), -2)) for (pk, pv), (k, v) in zip(past, kv)] if past else kv
    torch.testing.assert_close(torch.cat(outputs, 1), stage(tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunks, slices", [(1, 2), (1, 4), (2, 2), (2, 4)])
def test_svpp_trains_like_one_process(chunks, slices):
    schedule = build_schedule("svpp", 2, 4, num_chunks=chunks, num_slices=slices)
    results = assert_trains_like_one_process(schedule)
    for result in results:  # every slice's stash, its keys and values included, is gone by the step's end
        assert all(record.stash[-1][1] == 0 for record in result.records)


def test_terapipe_and_checkpointed_slices_train_like_one_process():
    assert_trains_like_one_process(build_schedule("terapipe", 2, 2, num_slices=4))
    checkpointed = overlap_recompute(apply_checkpoint(build_schedule("svpp", 2, 4, num_slices=2)))
    results = assert_trains_like_one_process(checkpointed, steps=1)
    assert [r.records[0].recomputes for r in results] == [8, 8]


def test_weight_gradient_parts_train_like_one_process():
    costs = Costs(F=1, B=1, W=1, M_W=0.5)
    assert_trains_like_one_process(weight_parts(build_schedule("1f1b", 2, 4), costs, parts=3))
    assert_trains_like_one_process(
        weight_parts(build_schedule("svpp", 2, 4, num_chunks=2, num_slices=2), costs, parts=4)
    )


def test_slices_shrink_the_stash_as_the_simulator_predicts():
    """Peak stash of SVPP (s = 2, 4) against 1F1B on the same model and sequence: measured ratio
    against the simulator's, given the bytes one F of a stage stashes (per slice)."""
    plain = run_in_process(TrainSpec(build_schedule("1f1b", 2, 4), config=CONFIG, steps=1))
    for slices in (2, 4):
        schedule = build_schedule("svpp", 2, 4, num_slices=slices, costs=Costs(F=1, B=2))
        sliced = run_in_process(TrainSpec(schedule, config=CONFIG, steps=1))
        per_slice = [
            [sliced[d].records[0].entry_bytes[f"{d}F0.{s}" if s else f"{d}F0"] for s in range(slices)] for d in range(2)
        ]
        whole = [plain[d].records[0].entry_bytes[f"{d}F0"] for d in range(2)]
        predicted = simulate(schedule, Costs(M_B=per_slice)).peak_activation_memory
        predicted_plain = simulate(build_schedule("1f1b", 2, 4), Costs(M_B=whole)).peak_activation_memory
        for d in range(2):
            measured = sliced[d].records[0].peak_stash_bytes / plain[d].records[0].peak_stash_bytes
            assert measured == pytest.approx(predicted[d] / predicted_plain[d], rel=0.05)
