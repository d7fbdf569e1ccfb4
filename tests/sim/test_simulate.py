"""Simulator figures against the papers.

References: Mario (PPoPP'25) Fig. 2 baseline and Table 1; MEPipe (EuroSys'25) Table 3 for the
DAPPLE and VPP bubble ratios and VPP memory; Zero Bubble (ICLR'24) for `cost` and the bubble rate.
"""

import pytest

from pipeloom import Costs, Schedule, build_schedule, simulate
from pipeloom.errors import ConfigError


def test_mario_figure_2_baseline_1f1b_makespan_is_21():
    timeline = simulate(build_schedule("1f1b", num_devices=4, num_microbatches=4), Costs(F=1, B=2))
    assert timeline.makespan == 21
    assert timeline.cost == 21


@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_1f1b_and_gpipe_bubble_ratio(name):
    for p in (2, 3, 4, 5, 7, 8, 16):  # m from p up: no spare micro-batch, an odd one over, several rounds
        for m in sorted({p, p + 1, 2 * p - 1, 2 * p, 3 * p + 1, 4 * p}):
            timeline = simulate(build_schedule(name, p, m), Costs(F=1, B=2))
            assert timeline.bubble_rate == pytest.approx((p - 1) / (m + p - 1)), (p, m)


@pytest.mark.parametrize("F, B", [(1, 1), (1, 2), (2, 3)])
def test_interleaved_bubble_ratio_is_mepipe_table_3_vpp(F, B):
    for p in (2, 3, 4, 8):
        for v in (2, 3, 4):
            for m in (p, 2 * p, 4 * p):
                timeline = simulate(build_schedule("interleaved", p, m, num_chunks=v), Costs(F=F, B=B))
                assert timeline.bubble_rate == pytest.approx((p - 1) / (v * m + p - 1)), (p, v, m)


def test_gpipe_holds_every_microbatch_on_every_device():  # Mario Table 1: N·Mθ
    for p, m in [(2, 3), (4, 8), (8, 5)]:
        assert simulate(build_schedule("gpipe", p, m)).peak_memory == [m] * p


def test_1f1b_memory_falls_from_d_to_one():  # Mario Table 1: [Mθ, D·Mθ]
    for p in (2, 4, 8, 16):
        assert simulate(build_schedule("1f1b", p, 2 * p)).peak_memory == list(range(p, 0, -1))


def test_1f1b_with_fewer_microbatches_than_devices():
    assert simulate(build_schedule("1f1b", 8, 3)).peak_memory == [3, 3, 3, 3, 3, 3, 2, 1]


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_memory(v):
    """Device 0 holds Megatron's 2(p-1)+(v-1)p warm-up chunks plus one steady-state forward, each
    M_B/v: (1 + (p-1)/(pv))·A with A = p·M_B, MEPipe Table 3's VPP row. The last device holds
    (v-1)p+1 chunks; for v = 2 that is Mario Table 1's lower end (D+1)·Mθ/2. (Mario's upper end,
    (3D-2)·Mθ/2, counts the warm-up forwards only and misses the steady-state one.)"""
    for p in (2, 4, 8):
        peaks = simulate(build_schedule("interleaved", p, 2 * p, num_chunks=v), Costs(M_B=1)).peak_memory
        assert peaks[0] == pytest.approx((1 + (p - 1) / (p * v)) * p)
        assert peaks[-1] == pytest.approx(((v - 1) * p + 1) / v)
        assert peaks == sorted(peaks, reverse=True)


def test_chimera_memory_is_mario_table_1():  # [(D/2+1)·Mθ, D·Mθ], both ends and middle
    for p in (2, 4, 8, 16):
        peaks = simulate(build_schedule("chimera", p, p)).peak_memory
        assert min(peaks) == peaks[0] == peaks[-1] == p // 2 + 1
        assert max(peaks) == peaks[p // 2 - 1] == peaks[p // 2] == p


def test_static_memory_counts_replicated_stages_twice():
    costs = Costs(M_static=10, M_B=0)
    assert simulate(build_schedule("chimera", 4, 4), costs).static_memory == [20] * 4
    assert simulate(build_schedule("1f1b", 4, 4), costs).static_memory == [10] * 4
    assert simulate(build_schedule("interleaved", 4, 4, num_chunks=2), costs).static_memory == [10] * 4
    assert simulate(build_schedule("chimera", 4, 4), Costs(M_static=1, M_B=1)).peak_memory == [5, 6, 6, 5]


def test_a_tied_weight_is_held_once_by_a_device_hosting_both_ends():
    """The first and last stage each count a tied embedding (M_shared of their M_static); a device
    that hosts both holds one object, as the runtime does — a V's first device, Chimera's ends."""
    costs = Costs(M_static=[10.0, 20.0, 30.0, 40.0], M_shared=5.0, M_B=0)
    assert simulate(build_schedule("zb-v", 2, 4), costs).static_memory == [45.0, 50.0]  # stages 0 and 3 on device 0
    assert simulate(build_schedule("1f1b", 4, 4), costs).static_memory == [10.0, 20.0, 30.0, 40.0]
    chimera = simulate(build_schedule("chimera", 4, 4), Costs(M_static=10, M_shared=3, M_B=0))
    assert chimera.static_memory == [17, 20, 20, 17]
    assert Costs(M_shared=5.0).to_dict()["M_shared"] == 5.0 and "M_shared" not in Costs().to_dict()
    with pytest.raises(ConfigError, match="M_shared must be a non-negative number"):
        Costs(M_shared=-1.0)


def test_comm_delays_every_cross_device_edge():
    # F0 [0,1], comm, F1 [1.5,2.5], BW1 [2.5,4.5], comm, BW0 [5,7]
    timeline = simulate(build_schedule("1f1b", 2, 1), Costs(F=1, B=2, comm=0.5))
    assert [(t.op.text, t.start, t.end) for t in timeline.timings()] == [
        ("0F0", 0, 1),
        ("0BW0", 5, 7),
        ("1F0", 1.5, 2.5),
        ("1BW0", 2.5, 4.5),
    ]
    assert timeline.makespan == 7


def test_split_backward_memory_keeps_m_w_until_w():
    schedule = Schedule.from_text("0F0 0F1 0B0 0B1 0W0 0W1")
    timeline = simulate(schedule, Costs(F=1, B=1, W=1, M_B=3, M_W=1))
    assert timeline.peak_memory == [6]
    assert [level for _, level in timeline.memory_curve(0)] == [0, 3, 6, 4, 2, 1, 0]
    assert timeline.makespan == 6


def test_w_parts_share_time_and_memory():
    schedule = Schedule.from_text("0F0 0B0 0W0:0/2 0W0:1/2")
    timeline = simulate(schedule, Costs(F=1, B=1, W=2, M_B=2, M_W=1))
    assert [t.end - t.start for t in timeline.timings()] == [1, 1, 1, 1]
    assert [level for _, level in timeline.memory_curve(0)] == [0, 2, 1, 0.5, 0]


def test_checkpointed_forward_keeps_only_its_input_until_recompute():
    schedule = Schedule.from_text("0F0c 0F1c 0R0 0BW0 0R1 0BW1")
    timeline = simulate(schedule, Costs(F=1, B=2, M_B=4, M_ckpt=1))
    assert [level for _, level in timeline.memory_curve(0)] == [0, 1, 2, 5, 1, 4, 0]
    assert timeline.peak_memory == [5]
    assert timeline.useful_time == [6]  # recompute is overhead, not useful work
    assert timeline.busy_time == [8]


def test_cost_is_the_largest_span_and_bubble_uses_mean_useful_work():
    # Device 1 starts late: makespan counts from 0, its span from its first op.
    timeline = simulate(build_schedule("1f1b", 2, 2), Costs(F=1, B=1))
    assert timeline.spans == [6, 4]
    assert timeline.cost == max(timeline.spans) == timeline.makespan == 6
    assert timeline.bubble_rate == pytest.approx((6 - 4) / 6)
    uneven = simulate(build_schedule("1f1b", 2, 2), Costs(F=[1, 2], B=[1, 2]))
    assert uneven.useful_time == [4, 8]
    assert uneven.bubble_rate == pytest.approx((uneven.cost - 6) / uneven.cost)


def test_slices_run_causally_and_overlap_across_stages():
    schedule = Schedule.from_text("0F0 0F0.1 0BW0.1 0BW0\n1F0 1F0.1 1BW0.1 1BW0")
    timeline = simulate(schedule, Costs(F=1, B=2))  # per slice: F 1/2, BW 1
    assert [(t.op.text, t.start) for t in timeline.timings(1)] == [
        ("1F0", 0.5),
        ("1F0.1", 1),
        ("1BW0.1", 1.5),
        ("1BW0", 2.5),
    ]
    assert timeline.makespan == 4.5
    assert timeline.peak_memory == [1, 1]


def test_simulation_is_deterministic_and_every_op_respects_its_inputs():
    schedule = build_schedule("chimera", 8, 16)
    costs = Costs(F=[1, 2, 1, 3, 1, 1, 2, 1], B=2.5, comm=0.3)
    first, second = simulate(schedule, costs), simulate(schedule, costs)
    assert first.start == second.start and first.end == second.end
    graph = first.graph
    for g, deps in enumerate(graph.deps):
        for dep in deps:
            gap = costs.comm if graph.device_of[dep] != graph.device_of[g] else 0
            assert first.start[g] >= first.end[dep] + gap - 1e-9
    for d in range(8):
        intervals = [first.interval(d, step) for step in range(len(schedule.devices[d]))]
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(intervals, intervals[1:]))


def test_summary_has_the_cli_json_keys():
    summary = simulate(build_schedule("1f1b", 2, 2)).summary()
    assert {"name", "makespan", "cost", "bubble_rate", "peak_memory"} <= set(summary)


def test_a_bubble_never_reads_below_zero():
    """Useful time lies within each device's span, so a schedule with no idle time has a bubble
    of 0, not the rounding's -1e-16 that printed as "-0.00%" (zb-v with all-to-alls)."""
    costs = Costs(F=1, B=1, W=1, a2a_F=0.3, a2a_B=0.3)
    timeline = simulate(build_schedule("zb-v", 4, 8, costs=costs), costs)
    assert timeline.bubble_rate == 0.0 and f"{timeline.bubble_rate:.2%}" == "0.00%"
