"""Weight-gradient parts (MEPipe §5, Fig. 7): W cut per GEMM, run where the device waits."""

import random

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate
from pipeloom.ir.ops import OpKind
from pipeloom.passes import split_backward, weight_parts

# Fig. 7: slice 0's forward takes 75 % of slice 1's (attention over the longer prefix), a slice's
# backward as long as its forward, its weight gradient as long as slice 0's forward.
# (1 − a)/2 + a/4 = 0.75 · ((1 − a)/2 + 3a/4) gives a = 2/7.
FIG7 = Costs(F=1, B=1, W=(1 - 2 / 7) + (2 / 7) / 2, M_W=0.3, attention_fraction=2 / 7)  # W per slice: F[0]


def test_figure_7_costs():
    table = FIG7.resolve(4, 4, 2)
    assert table.F[0] == pytest.approx(0.75 * table.F[1])
    assert table.W[0] == pytest.approx(table.F[0])


def test_figure_7_parts_shorten_the_step():
    fused = build_schedule("svpp", 4, 4, num_slices=2, costs=FIG7)
    plain = simulate(fused, FIG7)
    after = simulate(split_backward(fused, "after"), FIG7)
    parted = weight_parts(fused, FIG7, parts=4)
    validate(parted)
    timeline = simulate(parted, FIG7)
    assert timeline.makespan < after.makespan <= plain.makespan
    assert max(timeline.peak_activation_memory) <= max(after.peak_activation_memory) + 1e-9


def test_every_w_is_cut_into_its_parts():
    schedule = weight_parts(build_schedule("zb-h1", 3, 6), Costs(F=1, B=1, W=1), parts=5)
    validate(schedule)
    parts = {}
    for _, _, op in schedule.ops():
        if op.kind is OpKind.W:
            assert op.parts == 5
            parts.setdefault(op.key, set()).add(op.part)
    assert len(parts) == 18 and all(found == set(range(5)) for found in parts.values())


def test_devices_with_spare_memory_defer_more():
    costs = Costs(F=1, B=1, W=1, M_W=0.5)
    schedule = weight_parts(build_schedule("1f1b", 4, 8), costs, parts=2)
    timeline = simulate(schedule, costs)
    assert max(timeline.peak_activation_memory) <= 4 + 1e-9  # the default limit: 1F1B's own peak
    tail = []  # W parts after the device's last B
    for ops in schedule.devices:
        last_b = max(step for step, op in enumerate(ops) if op.kind is OpKind.B)
        tail.append(sum(op.kind is OpKind.W for op in ops[last_b:]))
    assert tail[0] < tail[-1]  # device 0 is at the limit; the last device defers


def test_a_memory_limit_is_respected():
    costs = Costs(F=1, B=1, W=1, M_W=0.5)
    for limit in (3.0, 3.5):
        schedule = weight_parts(build_schedule("1f1b", 4, 8), costs, parts=4, mem_limit=[4, limit, limit, limit])
        peaks = simulate(schedule, costs).peak_activation_memory
        assert all(peak <= max(limit, 4 - d) + 1e-9 for d, peak in enumerate(peaks[1:], 1))


def test_random_schedules_stay_valid_and_never_get_slower():
    rng = random.Random(4)
    for _ in range(30):
        name = rng.choice(["1f1b", "interleaved", "zb-h1", "svpp", "tpipe"])
        p, m = rng.randint(2, 5), rng.randint(1, 8)
        kwargs = {"num_slices": rng.randint(1, 3)} if name == "svpp" else {}
        if name == "interleaved":
            m = p * rng.randint(1, 2)
        schedule = build_schedule(name, p, m, **kwargs)
        costs = Costs(F=1, B=rng.uniform(1, 2), W=rng.uniform(0.2, 1), M_W=0.3, comm=rng.choice([0, 0.05]))
        parted = weight_parts(schedule, costs, parts=rng.randint(1, 6))
        validate(parted)
        baseline = (
            split_backward(schedule, "after") if any(op.kind is OpKind.BW for _, _, op in schedule.ops()) else schedule
        )
        assert simulate(parted, costs).makespan <= simulate(baseline, costs).makespan + 1e-9


@pytest.mark.parametrize(
    "kwargs, message", [({"parts": 0}, "positive integer"), ({"mem_limit": [1, 2]}, "2 memory limits")]
)
def test_refusals(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        weight_parts(build_schedule("1f1b", 4, 4), Costs(W=1), **kwargs)
