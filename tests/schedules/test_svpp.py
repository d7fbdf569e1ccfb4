"""SVPP and TeraPipe (MEPipe §4, Table 3, Figures 4–6): memory and bubble by running the generator."""

import random

import pytest

from pipeloom import ConfigError, Costs, InfeasibleError, build_schedule, simulate, validate
from pipeloom.schedules.svpp import _best_of_policies, svpp_within

EQUAL = Costs(F=1, B=1)  # MEPipe's analysis: a slice's backward takes as long as its forward


def peak_share(schedule, costs=EQUAL) -> float:
    """Largest peak activation memory in units of A, one micro-batch through the whole model
    (p device shares, since Costs scalars are one device's share)."""
    return max(simulate(schedule, costs).peak_activation_memory) / schedule.num_devices


def svpp(p, n, v, s, **kwargs):
    return build_schedule("svpp", p, n, num_chunks=v, num_slices=s, costs=EQUAL, **kwargs)


def test_figure_4_and_6_memory():
    assert peak_share(svpp(4, 4, 1, 2)) == 5 / 8  # Fig. 4(a)
    assert peak_share(svpp(4, 4, 2, 2)) == 9 / 16  # Fig. 4(b)
    assert peak_share(svpp(4, 2, 2, 2)) == 1 / 2  # Fig. 6: two micro-batches


# (p, v, s, n) with n >= p: s below, at and above p, one to three chunks.
TABLE3_SMALL_CLUSTER = [
    (4, 1, 2, 4),
    (4, 2, 2, 4),
    (4, 2, 2, 8),
    (4, 1, 4, 8),
    (8, 2, 2, 8),
    (8, 2, 4, 16),
    (8, 1, 16, 8),
    (4, 3, 2, 4),
    (4, 2, 4, 4),
    (4, 2, 8, 4),
    (8, 2, 8, 16),
    (2, 3, 4, 2),
    (4, 3, 8, 8),
]


@pytest.mark.parametrize("p, v, s, n", TABLE3_SMALL_CLUSTER)
def test_table_3_small_cluster(p, v, s, n):
    schedule = svpp(p, n, v, s)
    assert simulate(schedule, EQUAL).bubble_rate == pytest.approx((p - 1) / (n * s * v + p - 1))
    assert peak_share(schedule) == pytest.approx((v * max(p, s) + min(p, s) - 1) / (v * s * p))


def test_deep_chunk_backwards_first_meet_table_3_where_descendant_order_falls_short():
    """MEPipe's "children" order ties (slice 3, chunk 0) with (slice 1, chunk 1) and takes the
    shallow one: p=2, n=1, v=2, s=4 then ends at 19 slice-times instead of Table 3's 18."""
    schedule = svpp(2, 1, 2, 4)
    assert simulate(schedule, EQUAL).bubble_rate == pytest.approx(1 / 9)
    order = [op.text for op in schedule.devices[0] if op.kind.value != "F"]
    assert order[:4] == ["2BW0.3", "2BW0.2", "2BW0.1", "2BW0"]  # the deep chunk's backwards first


@pytest.mark.parametrize(
    "p, v, s, n",
    [(4, 2, 2, 2), (8, 2, 2, 4), (8, 1, 2, 2), (8, 2, 1, 4), (8, 1, 4, 4), (8, 2, 4, 1), (8, 2, 4, 4), (2, 2, 4, 1)]
    + [(8, 2, 8, 2), (4, 3, 8, 1), (8, 3, 4, 4), (2, 3, 8, 1)],
)
def test_table_3_large_cluster(p, v, s, n):
    idle = p - 1 + (v - 1) * max(p - s * n, 0)
    schedule = svpp(p, n, v, s)
    assert simulate(schedule, EQUAL).bubble_rate == pytest.approx(idle / (idle + n * v * s))
    expected = min((v * max(p, s) + min(p, s) - 1) / (v * s * p), n / p)
    assert peak_share(schedule) == pytest.approx(expected)


@pytest.mark.parametrize("p, n", [(4, 4), (4, 8), (8, 8), (8, 4), (8, 2)])
def test_table_3_rows_of_the_other_schedules(p, n):
    dapple = build_schedule("1f1b", p, n)
    assert simulate(dapple).bubble_rate == pytest.approx((p - 1) / (p - 1 + n))
    assert peak_share(dapple) == min(n, p) / p
    for s in (2, 4):
        tera = build_schedule("terapipe", p, n, num_slices=s)
        assert simulate(tera).bubble_rate == pytest.approx((p - 1) / (n * s + p - 1))
        assert peak_share(tera) == n / p
    if n >= p and n % p == 0:
        for v in (2, 3):
            vpp = build_schedule("interleaved", p, n, num_chunks=v)
            assert simulate(vpp).bubble_rate == pytest.approx((p - 1) / (p - 1 + n * v))
            # Table 3 prints min(1 + (p−1)/(pv), n/(vp)); the second term must be n/p (all n·v
            # chunks of A/(vp) held), as n = p shows: Megatron then runs every forward first.
            assert peak_share(vpp) == pytest.approx(min(1 + (p - 1) / (p * v), n / p))


def test_many_slices_drive_bubble_to_zero_and_memory_to_a_over_p():
    p, n = 4, 4
    bubbles, shares = [], []
    for s in (2, 8, 32):
        schedule = svpp(p, n, 1, s)
        bubbles.append(simulate(schedule, EQUAL).bubble_rate)
        shares.append(peak_share(schedule))
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[-1] < 0.03
    assert shares == sorted(shares, reverse=True) and shares[-1] < 1.1 / p


def test_fewer_forwards_trade_bubble_for_memory():
    shares, bubbles = [], []
    for f in range(4, 10):
        schedule = svpp(4, 4, 2, 2, forwards=f)
        shares.append(peak_share(schedule))
        bubbles.append(simulate(schedule, EQUAL).bubble_rate)
    assert shares == [f / 16 for f in range(4, 10)]  # f forwards of A/16 each
    assert bubbles == sorted(bubbles, reverse=True) and bubbles[0] > bubbles[-1]


def test_memory_limit_picks_the_largest_variant_that_fits():
    costs = Costs(F=1, B=2)
    for limit in (1.0, 1.3, 2.0):
        schedule = build_schedule("svpp", 4, 8, num_chunks=2, num_slices=2, costs=costs, mem_limit=limit)
        peak = max(simulate(schedule, costs).peak_activation_memory)
        assert peak <= limit and peak > limit - 0.25  # one more forward (A/16 = 0.25) would not fit
    with pytest.raises(InfeasibleError, match="device 0 needs 1"):
        build_schedule("svpp", 4, 8, num_chunks=2, num_slices=2, costs=costs, mem_limit=0.5)


def test_random_sizes_validate_and_the_generator_times_are_the_simulator_s():
    rng = random.Random(9)
    for _ in range(40):
        p, v, s, n = rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 4), rng.randint(1, 6)
        costs = Costs(
            F=rng.uniform(0.5, 2),
            B=rng.uniform(0.5, 3),
            W=rng.uniform(0, 1),
            comm=rng.choice([0, 0.05]),
            attention_fraction=rng.choice([0, 0.3]),
        )
        f = rng.randint(v * s, v * s * n)
        built = _best_of_policies(p, n, v, s, f, costs)
        validate(built.schedule)
        assert built.schedule.num_ops == 2 * v * p * n * s
        timeline = simulate(built.schedule, costs)
        assert timeline.makespan == pytest.approx(built.makespan)
        per_forward = max(costs.resolve(p, v * p, s).M_B)
        assert max(timeline.peak_activation_memory) <= f * per_forward + 1e-9
        validate(build_schedule("terapipe", p, n, num_slices=s))


def test_within_a_room_the_shortest_policy_that_fits_or_a_refusal():
    """The tuner's build: at f forwards, the shortest policy whose activations fit the room. With
    room for every policy it is the plain build; with less it still fits (a run stops at the
    first device over its room, and the rest are kept); below what any policy holds, refused."""
    rng = random.Random(12)
    tighter = 0
    for _ in range(30):
        p, v, s, n = rng.randint(2, 5), rng.randint(1, 2), rng.randint(1, 4), rng.randint(2, 8)
        costs = Costs(F=rng.uniform(0.5, 2), B=rng.uniform(0.5, 3), W=rng.uniform(0, 1), comm=rng.choice([0, 0.05]))
        f = rng.randint(v * s, v * s * n)
        plain = _best_of_policies(p, n, v, s, f, costs)
        peaks = simulate(plain.schedule, costs).peak_activation_memory
        roomy = svpp_within(p, n, v, s, f, costs, [peak + 1e-6 for peak in peaks])
        assert roomy.to_text() == plain.schedule.to_text()
        room = [peak + 1e-6 for peak in peaks]
        room[rng.randrange(p)] -= max(costs.resolve(p, v * p, s).M_B)  # one forward less on one device
        try:
            within = svpp_within(p, n, v, s, f, costs, room)
        except InfeasibleError:
            continue
        validate(within)
        assert all(peak <= limit + 1e-9 for peak, limit in zip(simulate(within, costs).peak_activation_memory, room))
        tighter += within.to_text() != plain.schedule.to_text()
    assert tighter >= 3
    one_forward = max(Costs(F=1, B=2).resolve(4, 8, 2).M_B)
    with pytest.raises(InfeasibleError, match="under every policy"):
        svpp_within(4, 8, 2, 2, 9, Costs(F=1, B=2), [one_forward / 2] * 4)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"num_slices": 0}, "num_slices"),
        ({"num_chunks": 2, "num_slices": 2, "forwards": 3}, "at least 4"),
        ({"forwards": 4, "mem_limit": 2}, "not both"),
        ({"mem_limit": [1, 2]}, "2 memory limits given for 4 devices"),
    ],
)
def test_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule("svpp", 4, 4, **kwargs)
