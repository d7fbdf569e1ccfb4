"""T-Offload (TPipe §5, appendix D): lanes beside the schedule, delays only by the overflow."""

import math
import random

import pytest

from pipeloom import ConfigError, Costs, build_schedule
from pipeloom.passes.offload import LaneOpKind, simulate_offload, t_offload
from pipeloom.passes.trecomp import t_recomp

RELOAD, OFFLOAD, HOST_STEP = LaneOpKind.RELOAD, LaneOpKind.OFFLOAD, LaneOpKind.HOST_STEP


def lane_costs(**values) -> Costs:
    return Costs(F=1, B=2, host_bandwidth=1, host_flops=1, **values)


def test_default_offloads_every_chunk_but_the_shallowest():
    assert t_offload(build_schedule("tpipe", 4, 8)).stages == (4, 5, 6, 7)
    assert t_offload(build_schedule("tpipe", 2, 4, num_chunks=3)).stages == (2, 3, 4, 5)


def test_work_that_fits_its_bubbles_costs_nothing():
    schedule = build_schedule("tpipe", 8, 16)
    result = simulate_offload(
        t_offload(schedule), lane_costs(offload_bytes=2, host_step_flops=2, reload_bytes=2, M_static=4, M_offload=2)
    )
    assert result.delay == 0 and result.on_time_fraction == 1.0
    assert result.step_time == result.baseline.makespan
    assert result.timeline.makespan == result.baseline.makespan
    assert result.static_memory_saved == [1.0] * 8  # M_offload 2 per device share, half of it in the deep chunk
    assert result.static_memory == [3.0] * 8
    assert result.timeline.peak_memory == [s + a for s, a in zip([3.0] * 8, result.baseline.peak_activation_memory)]


@pytest.mark.parametrize("overflow", [0.5, 1.0, 3.0])
def test_a_reload_past_its_forward_delays_by_exactly_the_overflow(overflow):
    schedule = build_schedule("1f1b", 4, 8)  # stage 0 runs first: its reload is on the critical path
    window = 0.0
    result = simulate_offload(
        t_offload(schedule, [0]), lane_costs(reload_bytes=overflow)
    )  # 1F1B: a stage is one device share
    (reload,) = [op for op in result.lane_ops if op.kind is RELOAD]
    assert reload.deadline == window and reload.end == overflow
    assert result.delay == pytest.approx(overflow)
    assert result.overlap_fraction == 0.0 and result.on_time_fraction == 0.0  # device 0 idles only to wait for it


@pytest.mark.parametrize("overflow", [0.25, 2.0])
def test_host_work_past_the_step_delays_by_exactly_the_overflow(overflow):
    schedule = build_schedule("tpipe", 4, 8)
    baseline = simulate_offload(t_offload(schedule, [4]), lane_costs())
    last_backward_end = max(op.end for op in baseline.lane_ops if op.kind is OFFLOAD)
    bubble = baseline.step_time - last_backward_end
    offload, host = 1.0, bubble + overflow - 1.0  # the chain offload → host step is overflow longer than the bubble
    result = simulate_offload(
        t_offload(schedule, [4]),
        lane_costs(offload_bytes=offload * 2, host_step_flops=host * 2),  # a chunk is half a share
    )
    assert result.delay == pytest.approx(overflow)
    assert result.on_time_fraction == pytest.approx(bubble / (bubble + overflow))


def idle_share_by_hand(result) -> float:
    """The lanes' work inside device idle time and before its deadline, from the op timings."""
    inside = total = 0.0
    for op in result.lane_ops:
        total += op.end - op.start
        busy = sorted((t.start, t.end) for t in result.timeline.timings(op.device))
        at, end = op.start, min(op.end, op.deadline, result.timeline.makespan)
        for start, stop in busy + [(end, end)]:
            if start > at:
                inside += max(0.0, min(start, end) - at)
            at = max(at, stop)
            if at >= end:
                break
    return inside / total


def test_overlap_counts_work_inside_bubbles_not_work_on_time():
    """The issue's case: every gradient offload ends before the step does (on time), but part of
    it runs while device 0 still computes its shallow chunk's backwards."""
    schedule = build_schedule("tpipe", 8, 16)
    result = simulate_offload(t_offload(schedule), lane_costs(offload_bytes=16))
    assert result.on_time_fraction == 1.0 and result.delay == 0
    assert result.overlap_fraction == pytest.approx(idle_share_by_hand(result))
    assert 0.3 < result.overlap_fraction < 0.9
    device0 = [op for op in result.lane_ops if op.device == 0 and op.kind is OFFLOAD]
    (window,) = [w for w in result.windows if w.device == 0]
    assert window.offload < device0[0].end - device0[0].start  # more work than the bubble holds


@pytest.mark.parametrize("p", range(3, 17))
def test_windows_match_tpipe_appendix_d(p):
    """TPipe appendix D: on device 0 the deep chunk's gradients can leave in p − ⌈(2p−3)/6⌉ − 1
    chunk backwards of idle time, and its weights arrive in p − ⌈(p−3)/6⌉ − 1 chunk forwards."""
    result = simulate_offload(t_offload(build_schedule("tpipe", p, 3 * p)), lane_costs())
    (window,) = [w for w in result.windows if w.device == 0]
    chunk_forward, chunk_backward = 0.5, 1.0  # F = 1, B = 2 per device share, two chunks
    assert window.stage == p
    assert window.offload == pytest.approx((p - math.ceil((2 * p - 3) / 6) - 1) * chunk_backward)
    assert window.reload == pytest.approx((p - math.ceil((p - 3) / 6) - 1) * chunk_forward)


@pytest.mark.parametrize("share, delay", [(1.0, 1.0), (0.5, 0.75), (0.0, 0.5)])
def test_reloads_yield_to_p2p_arriving_on_the_same_link(share, delay):
    """Device 1's stage-1 weights (2 time units) reload while stage 0's activation arrives over
    [1, 1.5]; its forward was due at 1.5. A shared link pauses the copy for the transfer."""
    schedule = build_schedule("1f1b", 2, 1)
    costs = lane_costs(reload_bytes=2, comm=0.5, p2p_host_link_share=share)
    result = simulate_offload(t_offload(schedule, [1]), costs)
    (reload,) = result.lane_ops[:1]
    assert (reload.kind, reload.deadline) == (RELOAD, 1.5)
    assert reload.end == pytest.approx(1.5 + delay)
    assert result.delay == pytest.approx(delay)


def test_gradient_offloads_yield_to_p2p_leaving_the_device():
    schedule = build_schedule("tpipe", 4, 8)
    ends = {}
    for share in (0.0, 1.0):
        costs = lane_costs(offload_bytes=8, comm=0.25, p2p_host_link_share=share)
        result = simulate_offload(t_offload(schedule), costs)
        ends[share] = [op.end for op in result.lane_ops if op.kind is OFFLOAD]
    assert all(shared >= alone for shared, alone in zip(ends[1.0], ends[0.0]))
    assert ends[1.0] != ends[0.0]


def test_quantized_reload_moves_fewer_bytes():
    schedule = build_schedule("tpipe", 4, 8)
    full = simulate_offload(t_offload(schedule), lane_costs(reload_bytes=8))
    eight_bit = simulate_offload(t_offload(schedule, reload_bits=8), lane_costs(reload_bytes=8))
    full_lengths, eight_bit_lengths = (
        [op.end - op.start for op in result.lane_ops if op.kind is RELOAD] for result in (full, eight_bit)
    )
    assert eight_bit_lengths == [length / 2 for length in full_lengths] and min(full_lengths) > 0


def test_lanes_never_overlap_themselves_and_wait_for_their_inputs():
    rng = random.Random(3)
    for _ in range(40):
        p, v = rng.randint(2, 6), rng.randint(2, 3)
        schedule = build_schedule("tpipe", p, rng.randint(1, 3 * p), num_chunks=v)
        if rng.random() < 0.5:
            schedule = t_recomp(schedule)
        stages = sorted(rng.sample(range(v * p), rng.randint(1, v * p)))
        costs = lane_costs(
            offload_bytes=rng.uniform(0, 20), reload_bytes=rng.uniform(0, 20), host_step_flops=rng.uniform(0, 20)
        )
        result = simulate_offload(t_offload(schedule, stages), costs)
        assert result.delay >= -1e-9 and 0 <= result.overlap_fraction <= result.on_time_fraction + 1e-9 <= 1 + 1e-9
        lanes: dict = {}
        for op in result.lane_ops:
            lanes.setdefault((op.device, op.kind.lane), []).append(op)
        for ops in lanes.values():
            ops.sort(key=lambda op: op.start)
            assert all(a.end <= b.start + 1e-9 for a, b in zip(ops, ops[1:]))
        by_stage = {(op.kind, op.stage): op for op in result.lane_ops}
        for stage in stages:
            assert by_stage[HOST_STEP, stage].start >= by_stage[OFFLOAD, stage].end - 1e-9
        first_forward = {}
        for timing in result.timeline.timings():
            if timing.op.kind.value == "F":
                first_forward.setdefault(timing.op.stage, timing.start)
        for stage in stages:
            assert first_forward[stage] >= by_stage[RELOAD, stage].end - 1e-9


def test_replicated_stages_count_on_each_device():
    result = simulate_offload(t_offload(build_schedule("chimera", 4, 4), [0]), Costs(M_static=2, M_offload=1))
    assert result.static_memory_saved == [1.0, 0.0, 0.0, 1.0]  # stage 0 lives on devices 0 and 3


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: t_offload(build_schedule("1f1b", 4, 4)), "name the stages"),
        (lambda: t_offload(build_schedule("tpipe", 4, 4), [8]), "among 0..7"),
        (lambda: t_offload(build_schedule("tpipe", 4, 4), reload_bits=0), "reload_bits"),
        (
            lambda: simulate_offload(t_offload(build_schedule("tpipe", 4, 4)), Costs(offload_bytes=1)),
            "host_bandwidth",
        ),
        (
            lambda: simulate_offload(t_offload(build_schedule("tpipe", 4, 4)), Costs(host_step_flops=1)),
            "host_flops",
        ),
        (
            lambda: simulate_offload(t_offload(build_schedule("tpipe", 4, 4)), Costs(M_static=1, M_offload=2)),
            "exceeds its M_static",
        ),
        (lambda: Costs(host_bandwidth=0), "positive"),
    ],
)
def test_refusals(call, message):
    with pytest.raises(ConfigError, match=message):
        call()
