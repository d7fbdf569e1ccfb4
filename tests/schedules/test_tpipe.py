"""T-Pipe (TPipe §4.1, appendix A): memory and bubble formulas, intervals, domain."""

import math
import random

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate
from pipeloom.ir.ops import OpKind
from pipeloom.schedules.tpipe import slot_template

# Appendix A's units: T_B = 2 T_F; a chunk's forward takes T_unit = T_fwd / 2p, and a chunk of one
# micro-batch holds one block of activations, m_a / 2p, where m_a is 1F1B's peak (p micro-batches
# of 1/p of the model). With Costs() (F=1, B=2, M_B=1 per device share) both are 1/2 for v = 2.
UNIT = BLOCK = 0.5


def appendix_a_blocks(p: int) -> int:
    """Peak activation blocks of chunk 1 plus chunk 2 at device 0 (appendix A)."""
    chunk1 = math.ceil(2 / 3 + math.ceil((p - 3) / 6) + math.ceil((2 * p - 3) / 6) + p / 2)
    chunk2 = math.ceil((3 * p - 2) / 6)
    return chunk1 + chunk2


@pytest.mark.parametrize("p", [4, 8, 16, 32])
def test_peak_activation_memory_follows_appendix_a(p):
    timeline = simulate(build_schedule("tpipe", p, 2 * p))
    one_f_one_b = simulate(build_schedule("1f1b", p, 2 * p))
    m_a = one_f_one_b.peak_activation_memory[0]
    assert m_a == p  # p micro-batches of one device's share
    assert timeline.peak_activation_memory[0] == appendix_a_blocks(p) * BLOCK
    assert max(timeline.peak_activation_memory) == timeline.peak_activation_memory[0]


def test_memory_tends_to_three_quarters_of_1f1b():
    shares = [simulate(build_schedule("tpipe", p, 2 * p)).peak_activation_memory[0] / p for p in (4, 8, 16, 32, 64)]
    assert shares == sorted(shares, reverse=True)
    assert shares[0] == 7 / 8 and 0.75 < shares[-1] < 0.76


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 13])
@pytest.mark.parametrize("m_of_p", [0.25, 1, 2, 4])
def test_bubble_ratio_equals_1f1b(p, m_of_p):
    m = max(1, int(m_of_p * p))
    timeline = simulate(build_schedule("tpipe", p, m))
    assert timeline.makespan == 6 * (m + p - 1) * UNIT
    assert timeline.bubble_rate == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p", range(2, 41))
def test_intervals_between_chunks_follow_appendix_a(p):
    """T_fwd_interval and T_bwd_interval of Fig. 16, in units, from the construction."""
    template = slot_template(p, 2)
    start = template.start
    F, BW = OpKind.F, OpKind.BW
    forward_interval = start[F, p] - (start[F, p - 1] + 1)  # last chunk-1 forward → first chunk-2 forward
    backward_interval = start[BW, p - 1] - (start[BW, p] + 2)  # last chunk-2 backward → first chunk-1 backward
    assert forward_interval == 3 + 6 * math.ceil((p - 3) / 6) - p
    assert backward_interval == 3 + 6 * math.ceil((2 * p - 3) / 6) - 2 * p
    assert template.period == 6


@pytest.mark.parametrize("v", [3, 4])
def test_more_chunks_keep_1f1b_bubble_and_hold_less(v):
    for p in (2, 4, 8):
        m = 2 * p
        tpipe = simulate(build_schedule("tpipe", p, m, num_chunks=v))
        one_f_one_b = simulate(build_schedule("1f1b", p, m))
        assert tpipe.bubble_rate == pytest.approx(one_f_one_b.bubble_rate)
        assert max(tpipe.peak_activation_memory) < max(one_f_one_b.peak_activation_memory)


def test_random_sizes_validate_under_random_costs():
    rng = random.Random(5)
    for _ in range(60):
        p, v = rng.randint(2, 9), rng.randint(2, 4)
        m = rng.randint(1, 3 * p)
        schedule = build_schedule("tpipe", p, m, num_chunks=v)
        validate(schedule)
        assert schedule.num_ops == 2 * v * p * m
        costs = Costs(F=rng.uniform(0.5, 2), B=rng.uniform(1, 4), comm=rng.choice([0, 0.1]))
        assert simulate(schedule, costs).makespan > 0


@pytest.mark.parametrize("p, v", [(1, 2), (4, 1), (4, 0)])
def test_outside_domain_is_refused(p, v):
    with pytest.raises(ConfigError, match="tpipe"):
        build_schedule("tpipe", p, 4, num_chunks=v)
