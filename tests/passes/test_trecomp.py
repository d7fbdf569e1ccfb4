"""T-Recomp (TPipe §4.2, appendices B and C): block-wise recompute of shallow chunks."""

import itertools
import math

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate
from pipeloom.ir.ops import OpKind
from pipeloom.passes import apply_checkpoint
from pipeloom.passes.trecomp import chunk_delay_rounds, t_recomp

UNIT = BLOCK = 0.5  # appendix A's T_unit and m_a / 2p under Costs() with two chunks (see test_tpipe)
NO_INPUT = Costs(M_ckpt=0)  # the appendix counts activations only, not a checkpointed chunk's input


def one_f_one_b_half_recompute(p: int, m: int):
    """1F1B recomputing half of every stage's layers (recompute_fraction 0.5)."""
    return simulate(apply_checkpoint(build_schedule("1f1b", p, m)), Costs(recompute_fraction=0.5))


@pytest.mark.parametrize("fraction", [0.25, 0.5, 0.75, 1.0])
def test_partial_recompute_keeps_the_other_layers_and_reruns_its_share(fraction):
    """TPipe's "1F1B + 50 % recompute" and Megatron's --recompute-num-layers: a checkpointed
    forward keeps its input and the (1 − r) share of activations it does not recompute; R takes
    r of a forward. 1F1B's first device then holds p of those and one recomputed share."""
    p, m = 4, 8
    costs = Costs(F=2, B=4, R=2, M_B=1, M_ckpt=0.1, recompute_fraction=fraction)
    timeline = simulate(apply_checkpoint(build_schedule("1f1b", p, m)), costs)
    assert timeline.makespan == pytest.approx((m + p - 1) * (2 + 4 + 2 * fraction))
    kept = 0.1 + (1 - fraction)
    assert timeline.peak_activation_memory[0] == pytest.approx(p * kept + (1 - kept))
    with pytest.raises(ConfigError, match="recompute_fraction"):
        Costs(recompute_fraction=0)


@pytest.mark.parametrize("p", range(3, 33))
def test_tpipe_activation_plus_buffer_is_half_p_plus_one_blocks(p):
    for m in (p, 2 * p):
        timeline = simulate(t_recomp(build_schedule("tpipe", p, m)), NO_INPUT)
        assert max(timeline.peak_activation_memory) == (p // 2 + 1) * BLOCK


@pytest.mark.parametrize("p", [3, 4, 5, 8, 9, 16, 32])
def test_tpipe_time_within_appendix_c_and_below_1f1b_with_half_recompute(p):
    for m in (p, 2 * p, 4 * p):
        timeline = simulate(t_recomp(build_schedule("tpipe", p, m)), NO_INPUT)
        half = one_f_one_b_half_recompute(p, m)
        assert half.makespan == 7 * (m - 1 + p) * UNIT  # appendix C's baseline, simulated
        assert timeline.makespan <= (6 * p + 7 * (m - 1)) * UNIT
        assert timeline.makespan < half.makespan
    assert simulate(t_recomp(build_schedule("tpipe", 4, 8)), NO_INPUT).makespan == (6 * 4 + 7 * 7) * UNIT


def appendix_b_delay(p: int) -> int:
    """Appendix B, equation (3): the least k >= 0 with T_fwd_interval − ΔT_fwd_interval + 7k >= 0."""
    interval = 3 + 6 * math.ceil((p - 3) / 6) - p
    shrink = math.ceil((p - 1) / 2) - math.ceil((p - 3) / 6) - 1
    return max(0, math.ceil((shrink - interval) / 7))


def test_chunk_two_delay_is_computed_and_matches_appendix_b():
    # The construction finds the delay; equation (3) predicts it for every p.
    assert [chunk_delay_rounds(p)[0] for p in range(3, 61)] == [appendix_b_delay(p) for p in range(3, 61)]
    # One round at the ends of the paper's range 8 <= p <= 40 and none below it. Between, equation
    # (3) itself gives 0 (p = 10..12, 16, 17) or 2 (p = 27, 32, 33, 36..39): the paper's "k = 1 for
    # 8 <= p <= 40" holds for one round as the typical, not the only, delay.
    assert [chunk_delay_rounds(p)[0] for p in (8, 9, 40)] == [1, 1, 1]
    assert all(chunk_delay_rounds(p)[0] == 0 for p in range(3, 8))


def test_delay_rounds_are_reported_per_chunk():
    assert len(chunk_delay_rounds(8, num_chunks=4, chunks=(0, 1))) == 3


@pytest.mark.parametrize("p", [8, 16, 32])
def test_interleaved_with_trecomp_holds_about_half_of_1f1b(p):
    m = 2 * p
    m_a = simulate(build_schedule("1f1b", p, m)).peak_activation_memory[0]
    plain = simulate(build_schedule("interleaved", p, m, num_chunks=2)).peak_activation_memory[0]
    recomputed = simulate(t_recomp(build_schedule("interleaved", p, m, num_chunks=2)), NO_INPUT)
    assert plain > m_a  # interleaving alone holds more than 1F1B
    assert 0.5 <= max(recomputed.peak_activation_memory) / m_a <= 0.57


def test_recomputing_more_chunks_holds_less():
    peaks = [
        max(simulate(t_recomp(build_schedule("tpipe", 8, 16, num_chunks=4), range(k)), NO_INPUT).peak_activation_memory)
        for k in (1, 2, 3)
    ]
    assert peaks == sorted(peaks, reverse=True) and peaks[0] > peaks[-1]


def test_recompute_is_block_wise_and_decoupled():
    schedule = t_recomp(build_schedule("interleaved", 4, 8, num_chunks=2))
    validate(schedule)
    for ops in schedule.devices:
        for step, op in enumerate(ops):
            if op.kind is OpKind.R:
                assert not op.after_grad and op.stage < 4
                assert ops[step + 1].kind is OpKind.BW and ops[step + 1].key == op.key
            if op.kind is OpKind.F:
                assert op.ckpt == (op.stage < 4)
    assert schedule.name == "interleaved+trecomp"


def test_split_backward_schedules_take_it_too():
    from pipeloom.passes import split_backward

    validate(t_recomp(split_backward(build_schedule("interleaved", 2, 4, num_chunks=3), "after"), [0, 1]))


@pytest.mark.parametrize(
    "schedule, chunks, message",
    [
        (build_schedule("1f1b", 4, 4), None, "at least 2 chunks"),
        (build_schedule("chimera", 4, 4), None, "at least 2 chunks"),
        (build_schedule("zb-v", 4, 8), None, "device s mod p"),
        (build_schedule("tpipe", 4, 4), [2], "among 0..1"),
        (build_schedule("tpipe", 4, 4), [], "among 0..1"),
        (apply_checkpoint(build_schedule("tpipe", 4, 4)), None, "already checkpointed"),
    ],
)
def test_refusals(schedule, chunks, message):
    with pytest.raises(ConfigError, match=message):
        t_recomp(schedule, chunks)


@pytest.mark.parametrize("p", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("v", [2, 3, 4])
def test_every_chunk_set_recomputes_on_tpipe(p, v):
    """Recomputing the deepest chunk used to fail at p >= 3: its backward follows its forward too
    closely for a free recompute slot, so its backward now waits for one."""
    for k in range(1, v + 1):
        for chunks in itertools.combinations(range(v), k):
            schedule = t_recomp(build_schedule("tpipe", p, 3, num_chunks=v), chunks)
            validate(schedule)
            recomputes = [op for ops in schedule.devices for op in ops if op.kind is OpKind.R]
            assert len(recomputes) == 3 * p * len(chunks)
            assert simulate(schedule, Costs(F=1, B=2, W=0)).makespan > 0
