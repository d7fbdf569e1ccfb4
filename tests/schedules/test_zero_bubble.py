"""Zero Bubble family: Table 2 and appendix H of the paper, Table 5 from the profiled costs of
Table 6, memory limits honoured (checked by the simulator), V-shapes, validity under fuzzing."""

import random

import pytest

from pipeloom import ConfigError, Costs, InfeasibleError, OpKind, build_schedule, simulate, validate
from pipeloom.schedules.v_blocks import v_half_block, v_min_block
from pipeloom.schedules.v_search import paper_block_budget
from pipeloom.schedules.v_shape import v_placement
from pipeloom.tune.zb_profiles import PAPER_TABLE5, ZB_PROFILES

# (T_F, T_B, T_W) with T_W < T_F, T_B: the regime Table 2 describes (Table 1: T_W < T_F < T_B).
TIMES = [(1, 1, 1), (1, 1.5, 0.5), (1, 2, 1), (2, 2, 1), (1.2, 1, 0.8)]
M_W = 0.5


def costs(f, b, w, **extra):
    return Costs(F=f, B=b, W=w, M_B=1.0, M_W=M_W, **extra)


@pytest.mark.parametrize("f, b, w", TIMES)
@pytest.mark.parametrize("p", [2, 4, 8])
def test_table_2_bubble_and_peak_memory(f, b, w, p):
    c = costs(f, b, w)
    m = 3 * p
    h1 = simulate(build_schedule("zb-h1", p, m), c)
    assert h1.cost - m * (f + b + w) == pytest.approx((p - 1) * (f + b - w))
    # worker i (1-based): (p - i + 1)·M_B + (i - 1)·M_W; the peak, p·M_B, is on the first
    assert h1.peak_activation_memory == pytest.approx([(p - d) + d * M_W for d in range(p)])
    h2 = simulate(build_schedule("zb-h2", p, m), c)
    assert h2.cost - m * (f + b + w) == pytest.approx((p - 1) * (f + b - 2 * w))
    assert h2.peak_activation_memory == pytest.approx([(2 * p - 2 * d - 1) + 2 * d * M_W for d in range(p)])
    one_f_one_b = simulate(build_schedule("1f1b", p, m), c)
    assert one_f_one_b.cost - m * (f + b + w) == pytest.approx((p - 1) * (f + b + w))


@pytest.mark.parametrize("f, b, w", TIMES)
def test_appendix_h_few_microbatches(f, b, w):
    """m ≤ p: a ZB step takes (m+p−1)(T_F+T_B)+T_W, 1F1B (m+p−1)(T_F+T_B+T_W)."""
    c = costs(f, b, w)
    for p in (2, 4, 8):
        for m in range(1, p + 1):
            for name in ("zb-h1", "zb-h2"):
                assert simulate(build_schedule(name, p, m), c).cost == pytest.approx((m + p - 1) * (f + b) + w)
            for name in ("zb-1p", "zb-2p"):
                assert simulate(build_schedule(name, p, m, costs=c), c).cost == pytest.approx((m + p - 1) * (f + b) + w)
            assert simulate(build_schedule("1f1b", p, m), c).cost == pytest.approx((m + p - 1) * (f + b + w))


SMALL_PROFILES = [prof for prof in ZB_PROFILES if prof.num_devices <= 16]


@pytest.mark.parametrize("prof", SMALL_PROFILES, ids=lambda prof: f"{prof.model}-m{prof.num_microbatches}")
def test_table_5_from_the_profiled_costs(prof):
    """Bubble rates from Table 6's profiles: the handcrafted ones match Table 5 to its 4 decimals,
    the automatic ones are no worse (the larger profiles run in bench/zb_table5.py)."""
    c = prof.costs
    p, m = prof.num_devices, prof.num_microbatches
    paper = dict(zip(["1f1b", "interleaved", "zb-h1", "zb-h2", "zb-1p", "zb-2p"], PAPER_TABLE5[(prof.model, m)]))
    for name in ("1f1b", "zb-h1", "zb-h2"):
        assert round(simulate(build_schedule(name, p, m), c).bubble_rate, 4) == paper[name], name
    for name, limit in (("zb-1p", p), ("zb-2p", 2 * p)):
        timeline = simulate(build_schedule(name, p, m, costs=c), c)
        assert round(timeline.bubble_rate, 4) <= paper[name], name
        assert max(timeline.peak_activation_memory) <= limit + 1e-9


def random_costs(rng: random.Random, num_stages: int) -> Costs:
    """Uneven or even forwards, any B/W balance, some communication, M_W below M_B."""
    return Costs(
        F=rng.choice([1.0, [round(rng.uniform(0.5, 2), 2) for _ in range(num_stages)]]),
        B=round(rng.uniform(0.5, 2.5), 2),
        W=round(rng.uniform(0.1, 1.5), 2),
        comm=rng.choice([0, 0.05, 0.3]),
        M_W=round(rng.uniform(0, 0.9), 2),
    )


def test_handcrafted_schedules_validate_for_any_size():
    rng = random.Random(2)
    for _ in range(80):
        p, name = rng.randint(1, 12), rng.choice(["zb-h1", "zb-h2"])
        m = rng.randint(1, 3 * p)
        schedule = build_schedule(name, p, m)
        validate(schedule)
        assert schedule.num_ops == 3 * p * m


def test_auto_scheduler_never_exceeds_its_limit_and_validates():
    rng = random.Random(11)
    for case in range(60):
        p = rng.randint(1, 8)
        m = rng.randint(1, 4 * p)
        c = random_costs(rng, p)
        limit = rng.choice([1, round(rng.uniform(1, 2.5 * p), 1), [round(rng.uniform(1, 2 * p), 1) for _ in range(p)]])
        schedule = build_schedule("zb-auto", p, m, costs=c, mem_limit=limit)
        validate(schedule)
        timeline = simulate(schedule, c)
        limits = limit if isinstance(limit, list) else [limit] * p
        for peak, cap in zip(timeline.peak_activation_memory, limits):
            assert peak <= cap + 1e-9, (case, p, m, c, limit)


def test_v_shapes_validate_and_keep_their_budgets():
    rng = random.Random(5)
    for case in range(10):
        p = rng.randint(1, 8)
        m = rng.randint(1, 4 * p)
        c = random_costs(rng, 2 * p)
        table = c.resolve(p, 2 * p)
        for name, budget in (
            ("zb-v", p),
            ("v-half", paper_block_budget(v_half_block(p), table)[0]),
            ("v-min", paper_block_budget(v_min_block(p), table)[0]),
        ):
            schedule = build_schedule(name, p, m, costs=c)
            validate(schedule)
            assert [schedule.stages_on(d) for d in range(p)] == [[d, 2 * p - 1 - d] for d in range(p)]
            budget = max(budget, 1.0)  # never below one micro-batch through both stages
            assert max(simulate(schedule, c).peak_activation_memory) <= budget + 1e-9, (case, name, p, m)
        budget = [round(rng.uniform(1, 1.5 * p), 1) for _ in range(p)]
        peaks = simulate(build_schedule("v-auto", p, m, costs=c, mem_limit=budget), c).peak_activation_memory
        assert all(peak <= cap + 1e-9 for peak, cap in zip(peaks, budget))


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8, 12])
def test_zb_v_zero_bubble_at_1f1b_memory_when_times_are_equal(p):
    c = Costs(F=1, B=1, W=1, M_W=0.25)
    for m in (2 * p, 3 * p):
        timeline = simulate(build_schedule("zb-v", p, m, costs=c), c)
        assert timeline.bubble_rate == pytest.approx(0.0, abs=1e-12)
        assert max(timeline.peak_activation_memory) <= p + 1e-9  # 1F1B's p·M_B


def test_less_memory_costs_bubble_monotonically_in_the_v_family():
    c = Costs(F=1, B=1, W=1, M_W=0.25)
    rates = [simulate(build_schedule(name, 4, 12, costs=c), c).bubble_rate for name in ("zb-v", "v-half", "v-min")]
    assert rates[0] < rates[1] < rates[2]


def test_v_placement():
    assert v_placement(3) == [0, 1, 2, 2, 1, 0]


def test_memory_limits_below_one_microbatch_are_refused():
    with pytest.raises(InfeasibleError, match="raise the limit to at least 1"):
        build_schedule("zb-auto", 4, 8, mem_limit=0.5)
    with pytest.raises(InfeasibleError, match="device 1"):
        build_schedule("v-auto", 2, 4, mem_limit=[1, 0.6])
    with pytest.raises(ConfigError, match="3 memory limits given for 2 devices"):
        build_schedule("zb-auto", 2, 4, mem_limit=[1, 2, 3])


def test_zero_bubble_schedules_split_every_backward():
    for name in ("zb-h1", "zb-h2", "zb-auto", "zb-1p", "zb-2p", "zb-v", "v-half", "v-min", "v-auto"):
        schedule = build_schedule(name, 3, 5)
        kinds = {op.kind for _, _, op in schedule.ops()}
        assert kinds == {OpKind.F, OpKind.B, OpKind.W}, name
        validate(schedule)


def test_the_list_search_under_a_bound_finds_only_shorter_schedules():
    """`auto_schedule` abandons every run, the first included, once it cannot beat `bound`, and
    searches on from the flags that mattered until then: it returns a schedule within the bound
    or None, and under a bound the unbounded search's best beats, that best."""
    from pipeloom.schedules.auto_search import LINEAR_FLAGS, auto_schedule

    rng = random.Random(11)
    for _ in range(12):
        p, m = rng.randint(2, 6), rng.randint(2, 12)
        c = random_costs(rng, p)
        free = auto_schedule("zb", list(range(p)), m, c, 2.0 * p, flags=LINEAR_FLAGS)
        assert free is not None
        for bound in (free.cost + 1e-6, free.cost * 0.97, free.cost * 0.5):
            bounded = auto_schedule("zb", list(range(p)), m, c, 2.0 * p, flags=LINEAR_FLAGS, bound=bound)
            if bound > free.cost:
                assert bounded is not None and bounded.cost == pytest.approx(free.cost)
            else:
                assert bounded is None or bounded.cost <= bound + 1e-9


def test_a_w_that_keeps_more_than_its_b_frees_stays_within_the_budget():
    """With M_W > M_B a B grows its device's memory (it keeps M_W of the M_B it frees), so a
    forward is admitted for the most its micro-batch will hold. zb-auto at 2 M_B with M_W = 1.25
    once returned F0 F1 B0 on device 0 (2.25 M_B); every budgeted schedule must fit or be refused."""
    costs = Costs(F=1, B=1, W=1, M_W=1.25)
    timeline = simulate(build_schedule("zb-auto", 2, 2, costs=costs, mem_limit=2), costs)
    assert max(timeline.peak_activation_memory) <= 2
    rng = random.Random(8)
    for _ in range(60):
        p, m = rng.randint(1, 5), rng.randint(1, 12)
        costs = Costs(F=rng.uniform(0.5, 2), B=rng.uniform(0.5, 2), W=rng.uniform(0.2, 2), M_W=rng.uniform(1, 2))
        name = rng.choice(["zb-auto", "v-auto"])
        limit = rng.uniform(1, 2.5) * p * costs.M_W / (2 if name == "v-auto" else 1)
        try:
            schedule = build_schedule(name, p, m, costs=costs, mem_limit=limit)
        except InfeasibleError:
            continue
        assert max(simulate(schedule, costs).peak_activation_memory) <= limit + 1e-9, (name, p, m)
