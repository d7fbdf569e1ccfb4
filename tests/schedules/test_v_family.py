"""The V family's building blocks and searches: block memory by the paper's lifespan count, the
authors' named schedules matched or beaten, ZB-V never behind the paper's greedy, monotone in m,
every schedule valid and within its budget."""

import random

import pytest

from pipeloom import Costs, build_schedule, simulate, validate
from pipeloom.schedules.v_blocks import (
    PERIOD,
    WalkedDevice,
    _place_w,
    block_memory,
    block_times,
    slot_schedule,
    v_half_block,
    v_min_block,
)
from pipeloom.schedules.v_greedy import v_greedy
from pipeloom.tune.pareto import authors_points
from pipeloom.tune.zb_profiles import AUTHORS_V, ZB_PROFILES

BLOCKS = [v_min_block, v_half_block]


def lifespan_memory(block, device, chunk_memory):
    """The paper's count: at any slot of the steady state, a chunk holds the micro-batches whose
    F has run and whose W has not; with lifespan l that is ⌈l / 6⌉ or ⌊l / 6⌋ of them by phase."""
    repeats = 4 * block.num_devices + 8
    times = block_times(block, repeats)[device]
    _place_w(times)
    j = repeats // 2  # a micro-batch of the steady state, where W take their lasting slots
    base = times[0][j] - times[0][j] % PERIOD
    spans = [(times[0][j] - base, times[5][j] - base), (times[1][j] - base, times[4][j] - base)]  # F..W per chunk
    best = 0
    for r in range(PERIOD):
        live = sum(sum(1 for k in range(-200, 200) if f <= r + PERIOD * k < w + 1) for f, w in spans)
        best = max(best, live)
    return best * chunk_memory


@pytest.mark.parametrize("make", BLOCKS)
@pytest.mark.parametrize("p", [2, 3, 4, 5, 6, 8, 9, 12, 16])
def test_block_memory_is_the_lifespan_count_and_what_the_simulator_sees(make, p):
    block = make(p)
    m = 6 * p
    times = block_times(block, m)
    for dev in times:
        _place_w(dev)
    unrolled = slot_schedule("block", times, p, m)
    validate(unrolled)
    peaks = simulate(unrolled, Costs(F=1, B=1, W=1, M_W=1.0)).peak_activation_memory  # B frees nothing
    for d in range(p):
        formula = lifespan_memory(block, d, 0.5)
        assert block_memory(block, d, (0.5, 0.5), (0.5, 0.5)) == pytest.approx(formula)
        assert peaks[d] == pytest.approx(formula), (p, d)


def placed_peak(device_times, deltas):
    """The peak of one device's passes with its W placed afresh: what the walk must agree with."""
    times = [list(ts) for ts in device_times[:4]]
    _place_w(times)
    level = peak = 0.0
    for _, delta in sorted((t, deltas[kind]) for kind, ts in enumerate(times) for t in ts):
        level += delta
        peak = max(peak, level)
    return peak


def test_the_kept_walk_answers_as_placing_every_w_again():
    """The drain squeeze's shortcut (re-walk from the moved slot until the walk rejoins the old
    one) gives every try the peak that placing all of the device's W afresh gives."""
    rng = random.Random(3)
    for _ in range(60):
        p, m = rng.randint(2, 6), rng.randint(2, 12)
        device = rng.randrange(p)
        times = [ts[:] for ts in block_times(rng.choice(BLOCKS)(p), m)[device]]
        deltas = [rng.uniform(0.2, 1), rng.uniform(0.2, 1), -rng.uniform(0, 0.5), -rng.uniform(0, 0.5)]
        deltas += [-rng.uniform(0, 0.5), -rng.uniform(0, 0.5)]
        walk = WalkedDevice(times, deltas)
        for _ in range(30):
            kind, j = rng.randrange(4), rng.randrange(m)
            t = times[kind][j]
            busy = {slot for ts in times for slot in ts}
            free = [slot for slot in range(t) if slot not in busy]
            if not free:
                continue
            slot = rng.choice(free)
            times[kind][j] = slot
            truth = placed_peak(times, deltas)
            for limit in (truth - 1e-9, truth + 1e-9):  # levels summed in another order differ in ulps
                assert walk.fits(t, slot, kind, limit) == (truth <= limit)
            if rng.random() < 0.5:
                walk.move(t, slot, kind)
            else:
                times[kind][j] = t


@pytest.mark.parametrize("p", [4, 6, 8, 12, 16])
def test_paper_blocks_hold_about_a_half_and_a_third_of_1f1b(p):
    half = max(block_memory(v_half_block(p), d, (0.5, 0.5), (0.5, 0.5)) for d in range(p))
    least = max(block_memory(v_min_block(p), d, (0.5, 0.5), (0.5, 0.5)) for d in range(p))
    assert half <= p / 2 + 1
    assert least <= p / 3 + 1.5
    assert least < half < p


@pytest.mark.parametrize(
    "prof", [q for q in ZB_PROFILES if q.num_devices == 8], ids=lambda q: f"{q.model}-{q.num_microbatches}"
)
def test_authors_named_schedules_matched_or_beaten_at_their_memory(prof):
    p, m, costs = prof.num_devices, prof.num_microbatches, prof.costs
    strictly = 0
    for name, (bubble, peak) in AUTHORS_V[(prof.model, m)].items():
        timeline = simulate(build_schedule("v-auto", p, m, costs=costs, mem_limit=peak), costs)
        assert max(timeline.peak_activation_memory) <= peak + 1e-9
        assert round(timeline.bubble_rate, 4) <= bubble, name
        strictly += round(timeline.bubble_rate, 4) < bubble
    assert strictly >= 1


def test_zb_v_never_behind_the_papers_greedy():
    rng = random.Random(11)
    for case in range(15):
        p = rng.randint(2, 6)
        m = rng.randint(1, 4 * p)
        costs = Costs(
            F=round(rng.uniform(0.3, 3), 2), B=round(rng.uniform(0.3, 3), 2), W=round(rng.uniform(0.1, 3), 2),
            comm=rng.choice([0, 0.1, 0.4]), M_W=rng.choice([round(rng.uniform(0.05, 1), 2), 1.0]),
        )  # fmt: skip
        ours = simulate(build_schedule("zb-v", p, m, costs=costs), costs)
        greedy = simulate(v_greedy("greedy", p, m, costs.resolve(p, 2 * p), [p] * p), costs)
        assert ours.cost <= greedy.cost + 1e-9, (case, p, m, costs)
        assert max(ours.peak_activation_memory) <= p + 1e-9


@pytest.mark.parametrize("m_w", [0.5, 1.0])
def test_zb_v_bubble_does_not_grow_with_more_microbatches(m_w):
    costs = Costs(F=1, B=1, W=1, M_W=m_w)
    rates = [simulate(build_schedule("zb-v", 8, m, costs=costs), costs).bubble_rate for m in range(8, 50, 8)]
    assert all(later <= earlier + 1e-12 for earlier, later in zip(rates, rates[1:])), rates
    assert rates[-1] == pytest.approx(0.0, abs=1e-12)


def test_v_auto_keeps_any_budget_and_gets_no_worse_with_more():
    rng = random.Random(4)
    for case in range(6):
        p, m = rng.randint(2, 6), rng.randint(2, 20)
        costs = Costs(F=round(rng.uniform(0.5, 2), 2), B=round(rng.uniform(0.5, 2), 2), W=round(rng.uniform(0.2, 1.5), 2),
                      comm=rng.choice([0, 0.2]), M_W=round(rng.uniform(0.1, 0.9), 2))  # fmt: skip
        for budget in (1.0, p / 3 + 1, p / 2 + 1, p, 2 * p):
            schedule = build_schedule("v-auto", p, m, costs=costs, mem_limit=budget)
            validate(schedule)
            assert max(simulate(schedule, costs).peak_activation_memory) <= budget + 1e-9, (case, budget)


def test_pareto_marks_the_authors_points_only_for_table_6_profiles():
    prof = ZB_PROFILES[0]
    typed = Costs(F=18.522, B=18.086, W=9.337, comm=0.601, M_W=0.366)  # as the issue writes it
    labels = [q.label for q in authors_points(prof.num_devices, prof.num_microbatches, typed)]
    assert labels == ["authors: ZB-V", "authors: ZB-V@2p", "authors: V-Half", "authors: V-Min"]
    assert authors_points(8, 24, Costs(F=1, B=1, W=1)) == []
    assert authors_points(8, 25, typed) == []
