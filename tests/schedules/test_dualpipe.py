"""DualPipe and DualPipeV against the DeepSeek-V3 report's Table 2, and over a fuzz of sizes and costs.

Table 2 counts in chunks (PP stages, one chunk a stage): 1F1B's bubble is (PP−1)(F+B), ZB1P's
(PP−1)(F+B−2W), DualPipe's (PP/2−1)(F&B+B−3W), with B the full backward and F&B an overlapped
pair's time; DualPipe holds 2× parameters and PP+1 chunks of activations. The table is drawn with
a forward as long as the input-gradient part of a backward (F = B − W) and W ≤ F; there it is
exact. A bubble here is a device's span minus its busy time (a pair counted once).
"""

import random
from dataclasses import replace

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate
from pipeloom.ir.ops import OpKind


def worst_bubble(timeline) -> float:
    return max(span - busy for span, busy in zip(timeline.spans, timeline.busy_time))


def chunk_figures(schedule, costs):
    """(F, full B, W, F&B) of one chunk, as the table counts them."""
    table = costs.resolve(schedule.num_devices, schedule.num_stages)
    return table.F[0], table.B[0] + table.W[0], table.W[0], table.pair_time(0, 0, fused=True)


@pytest.mark.parametrize("stages", [4, 6, 8, 10, 12])
@pytest.mark.parametrize("w", [0.0, 0.25, 0.5, 1.0])
def test_report_table_2_bubbles_and_memory(stages, w):
    costs = Costs(F=1, B=1, W=w, M_B=1, M_static=1)  # F = B − W: the table's drawing
    for name, devices in (("dualpipe", stages), ("dualpipev", stages // 2)):
        schedule = build_schedule(name, devices, 3 * stages)
        timeline = simulate(schedule, costs)
        f, b, w_, fb = chunk_figures(schedule, costs)
        assert fb == pytest.approx(f + b)  # nothing to hide: F&B is F + B
        assert worst_bubble(timeline) == pytest.approx((stages / 2 - 1) * (fb + b - 3 * w_)), name
        chunk_activations = costs.resolve(devices, schedule.num_stages).M_B[0]
        assert max(timeline.peak_activation_memory) == pytest.approx((stages + 1) * chunk_activations), name
        assert timeline.static_memory == [2.0] * devices if name == "dualpipe" else [1.0] * devices
    one_f_one_b = simulate(build_schedule("1f1b", stages, 3 * stages), costs)
    zb1p = simulate(build_schedule("zb-h1", stages, 3 * stages), costs)
    assert worst_bubble(one_f_one_b) == pytest.approx((stages - 1) * (1 + 1 + w))
    assert worst_bubble(zb1p) == pytest.approx((stages - 1) * (1 + 1 + w - 2 * w))
    assert max(one_f_one_b.peak_activation_memory) == stages and max(zb1p.peak_activation_memory) == stages


@pytest.mark.parametrize("a2a", [0.2, 0.5, 1.0])
@pytest.mark.parametrize("stages", [4, 8, 12])
def test_report_bubble_with_the_pair_cost_when_there_is_communication(a2a, stages):
    """F&B now hides communication; lone ops still wait for theirs. With PP = 4 the table's bubble
    is exact with F&B the pair's time; deeper pipelines do better than the table, because fewer
    lone ops sit in the warm-up than its formula charges ((PP/2−2)·2·a2a less)."""
    costs = Costs(F=1, B=1, W=0.5, a2a_F=a2a, a2a_B=a2a)
    for name, devices in (("dualpipe", stages), ("dualpipev", stages // 2)):
        schedule = build_schedule(name, devices, 3 * stages)
        f, b, w, fb = chunk_figures(schedule, costs)
        assert fb < f + b  # the pair hides something
        table = (stages / 2 - 1) * (fb + b - 3 * w)
        chunk_a2a = costs.resolve(devices, schedule.num_stages).a2a_F[0]
        assert worst_bubble(simulate(schedule, costs)) == pytest.approx(table - (stages / 2 - 2) * 2 * chunk_a2a)


def test_pairs_gain_only_where_there_is_communication_to_hide():
    for name, p, m in (("dualpipe", 8, 32), ("dualpipev", 4, 16)):
        paired = build_schedule(name, p, m)
        unpaired = paired.with_devices([[replace(op, overlap_next=False) for op in ops] for ops in paired.devices])
        plain = Costs(F=1, B=1, W=1)
        moe = Costs(F=1, B=1, W=1, a2a_F=0.3, a2a_B=0.3)
        # Nothing to hide: a pair only makes its forward wait for its backward's input.
        assert simulate(paired, plain).makespan >= simulate(unpaired, plain).makespan
        assert simulate(paired, moe).makespan < 0.95 * simulate(unpaired, moe).makespan


def test_shapes():
    assert build_schedule("dualpipe", 2, 2).to_text().splitlines()[1:] == [
        "0F0 1F1 1BW1 0B0 0W0",
        "0F1 1F0 1BW0 0B1 0W1",
    ]
    dualpipev = build_schedule("dualpipev", 2, 4)
    assert dualpipev.num_stages == 4 and dualpipev.stages_on(0) == [0, 3] and dualpipev.stages_on(1) == [1, 2]
    assert dualpipev.to_text().splitlines()[2] == (
        "1F0 2F0 1F1 2F1 1F2 2BW0 2F2&1BW0 1F3&2BW1 2F3&1BW1 2BW2 1BW2 2B3 1B3 2W3 1W3"
    )
    dualpipe = build_schedule("dualpipe", 4, 8)
    assert dualpipe.stages_on(0) == [0, 3] and {op.microbatch for op in dualpipe.devices[0] if op.stage == 3} == {
        4,
        5,
        6,
        7,
    }


@pytest.mark.parametrize(
    "name, p, m, message",
    [
        ("dualpipe", 3, 8, r"number of devices \(3\) must be even"),
        ("dualpipe", 4, 7, r"micro-batches \(7\) must be even"),
        ("dualpipe", 8, 12, r"at least 2p − 2 = 14"),
        ("dualpipev", 4, 6, r"at least 2p − 1 = 7"),
    ],
)
def test_domain_errors_name_the_rule(name, p, m, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(name, p, m)


def test_the_domain_bound_is_the_true_one():
    """torch's ScheduleDualPipeV asks for m ≥ 2p; the steps are valid from 2p − 1 on."""
    for p in range(1, 9):
        validate(build_schedule("dualpipev", p, 2 * p - 1))
        if p % 2 == 0:
            validate(build_schedule("dualpipe", p, max(2, 2 * p - 2)))


def test_fuzz_valid_deadlock_free_and_everything_freed():
    rng = random.Random(20261123)
    for case in range(150):
        name = rng.choice(["dualpipe", "dualpipev"])
        p = rng.randint(1, 8)
        if name == "dualpipe":
            p += p % 2
            m = rng.randint(max(1, p - 1), 3 * p) * 2
        else:
            m = rng.randint(2 * p - 1, 5 * p)
        schedule = build_schedule(name, p, m)
        validate(schedule)
        costs = Costs(
            F=rng.uniform(0.2, 3),
            B=rng.uniform(0.2, 3),
            W=rng.uniform(0, 2),
            comm=rng.choice([0, 0.1, 0.5]),
            a2a_F=rng.choice([0, rng.uniform(0, 2)]),
            a2a_B=rng.choice([0, rng.uniform(0, 2)]),
            M_B=rng.uniform(0.5, 2),
            M_W=rng.uniform(0, 0.5),
        )
        timeline = simulate(schedule, costs)
        context = (case, name, p, m, costs)
        assert 0 <= timeline.bubble_rate < 1, context
        for device in range(p):
            assert timeline.memory_curve(device)[-1][1] == pytest.approx(0, abs=1e-9), context
        pairs = sum(op.overlap_next for ops in schedule.devices for op in ops)
        assert pairs >= p * (m // (1 if name == "dualpipev" else 2) - 2 * p), context
        assert all(op.kind is not OpKind.R for ops in schedule.devices for op in ops)


def test_checkpointing_keeps_pairs_and_the_reordering_passes_refuse_them():
    from pipeloom.passes import apply_checkpoint, mario

    schedule = build_schedule("dualpipev", 4, 8)
    checkpointed = apply_checkpoint(schedule)
    validate(checkpointed)  # each R runs just before the pair whose backward needs it
    assert sum(op.overlap_next for _, _, op in checkpointed.ops()) == sum(
        op.overlap_next for _, _, op in schedule.ops()
    )
    costs = Costs(F=1, B=1, W=1, M_B=1)
    assert max(simulate(checkpointed, costs).peak_activation_memory) < max(
        simulate(schedule, costs).peak_activation_memory
    )
    with pytest.raises(ConfigError, match="would split the overlapped pairs of 'dualpipev'"):
        mario(schedule, costs)


def test_given_costs_only_the_pairs_that_hide_something_stay():
    """A pair hides nothing when its time is its two ops' lone times; split, its order is never
    slower (the pair only made its forward wait) and holds the same memory."""
    for name, p, m in (("dualpipe", 8, 32), ("dualpipev", 4, 16), ("dualpipev", 8, 20)):
        reference = build_schedule(name, p, m)
        for a2a, comm in ((0.0, 0.0), (0.0, 0.1), (0.3, 0.05), (2.5, 0.0)):
            costs = Costs(F=1, B=1, W=0.7, comm=comm, a2a_F=a2a, a2a_B=a2a)
            ours = build_schedule(name, p, m, costs=costs)
            pairs = sum(op.overlap_next for _, _, op in ours.ops())
            assert (pairs == 0) == (a2a == 0), (name, a2a)
            assert [[replace(op, overlap_next=False) for op in ops] for ops in ours.devices] == [
                [replace(op, overlap_next=False) for op in ops] for ops in reference.devices
            ]
            mine, theirs = simulate(ours, costs), simulate(reference, costs)
            assert mine.makespan <= theirs.makespan + 1e-9, (name, a2a, comm)
            assert mine.peak_activation_memory == theirs.peak_activation_memory
