"""split_backward: the three W placements, 2BP's Table 1, and validity on every generator."""

import random

import pytest

from pipeloom import ConfigError, Costs, OpKind, build_schedule, simulate, validate
from pipeloom.passes import split_backward

EQUAL = Costs(F=1, B=1, W=1)  # 2BP Table 1: forward, backward-p1 and backward-p2 take equal time


def rows(schedule):
    return [" ".join(op.text for op in ops) for ops in schedule.devices]


@pytest.mark.parametrize("n", [2, 4, 8, 16])
def test_2bp_table_1_bubble_ratios(n):
    """Naive (one micro-batch) and GPipe defer every W to the end; 1F1B fills gaps first (2BP §3)."""
    cases = [
        # schedule, micro-batches, W placement, ratio without 2BP, ratio with 2BP
        ("gpipe", 1, "deferred", (n - 1) / n, 2 * (n - 1) / (2 * n + 1)),
        ("gpipe", n, "deferred", (n - 1) / (2 * n - 1), 2 * (n - 1) / (2 * (n - 1) + 3 * n)),
        ("1f1b", n, "fill", (n - 1) / (2 * n - 1), (n - 1) / (n - 1 + 3 * n)),
        ("1f1b", 2 * n, "fill", (n - 1) / (3 * n - 1), (n - 1) / (n - 1 + 6 * n)),
    ]
    for name, m, placement, fused, split in cases:
        schedule = build_schedule(name, n, m)
        assert simulate(schedule, EQUAL).bubble_rate == pytest.approx(fused), (name, m)
        two_bp = split_backward(schedule, placement, costs=EQUAL)
        assert simulate(two_bp, EQUAL).bubble_rate == pytest.approx(split), (name, m)


def test_after_places_each_w_right_after_its_b():
    assert rows(split_backward(build_schedule("1f1b", 2, 2), "after")) == [
        "0F0 0F1 0B0 0W0 0B1 0W1",
        "1F0 1B0 1W0 1F1 1B1 1W1",
    ]


def test_deferred_moves_every_w_to_the_end_and_batch_groups_stages():
    schedule = split_backward(build_schedule("interleaved", 2, 2, num_chunks=2), "deferred", batch=True)
    assert rows(schedule)[0] == "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 2W0 2W1 0W0 0W1"
    unbatched = split_backward(build_schedule("chimera", 4, 4), "deferred")
    batched = split_backward(build_schedule("chimera", 4, 4), "deferred", batch=True)
    for plain, grouped in zip(unbatched.devices, batched.devices):
        tail = [op for op in grouped if op.kind is OpKind.W]
        assert grouped[-len(tail) :] == tuple(tail) and sorted(map(str, tail)) == sorted(
            str(op) for op in plain if op.kind is OpKind.W
        )
        stages = [op.stage for op in tail]
        assert stages == sorted(stages, key=stages.index)  # contiguous per stage


def test_fill_keeps_every_other_op_on_time_and_never_lengthens_the_step():
    costs = Costs(F=1, B=1.5, W=0.7, comm=0.1, M_W=0.5)
    for name, kwargs in [("1f1b", {}), ("interleaved", {"num_chunks": 2}), ("chimera", {}), ("gpipe", {})]:
        schedule = build_schedule(name, 4, 8, **kwargs)
        deferred = simulate(split_backward(schedule, "deferred"), costs)
        filled = simulate(split_backward(schedule, "fill", costs=costs), costs)
        assert filled.cost <= deferred.cost + 1e-9
        times = {}
        for t in deferred.timings():
            if t.op.kind is not OpKind.W:
                times[t.op] = t.start
        for t in filled.timings():
            if t.op.kind is not OpKind.W:
                assert t.start == pytest.approx(times[t.op]), (name, t.op)


def test_split_is_valid_on_every_generator_and_policy(pick_schedule):
    rng = random.Random(3)
    for _ in range(120):
        _, schedule = pick_schedule(rng, ["gpipe", "1f1b", "interleaved", "chimera"], 8)
        m = schedule.num_microbatches
        costs = Costs(F=rng.uniform(0.5, 2), B=rng.uniform(0.5, 3), W=rng.uniform(0, 1.5), comm=rng.choice([0, 0.2]))
        placement = rng.choice(["after", "deferred", "fill"])
        split = split_backward(schedule, placement, costs=costs, batch=placement != "after" and rng.random() < 0.5)
        validate(split)
        assert split.num_ops == schedule.num_ops + schedule.num_stages * m
        assert not any(op.kind is OpKind.BW for _, _, op in split.ops())
        fused_cost = simulate(schedule, costs).cost
        assert simulate(split_backward(schedule, "after"), costs).cost <= fused_cost + 1e-9  # B alone is shorter


def test_bad_arguments():
    schedule = build_schedule("1f1b", 2, 2)
    with pytest.raises(ConfigError, match="unknown W placement 'late'"):
        split_backward(schedule, "late")
    with pytest.raises(ConfigError, match="batch=True"):
        split_backward(schedule, "after", batch=True)
