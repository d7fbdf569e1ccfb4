"""The gradient sync overlapped with the pipeline: each stage's all-reduce from its last backward on."""

import pytest

from pipeloom import Costs, build_schedule, simulate
from pipeloom.sim import exposed_sync, sync_lanes

COSTS = Costs(F=1, B=1, W=1)


def test_a_v_shape_hides_its_second_stage_s_sync_under_the_first_one_s_backwards():
    timeline = simulate(build_schedule("zb-v", 2, 2, costs=COSTS), COSTS)  # stage ops take 0.5, makespan 6.5
    assert timeline.makespan == pytest.approx(6.5)
    # device 0: stage 3's last W ends at 5.5, stage 0's at 6.5; one link, in that order:
    # stage 3's sync 5.5 → 7.5, then stage 0's 7.5 → 9.5
    assert sync_lanes(timeline, [2.0] * 4)[0] == pytest.approx((6.5, 9.5))
    assert exposed_sync(timeline, [2.0] * 4) == pytest.approx(3.0)  # 4.0 after the pipeline, 1.0 hidden
    assert exposed_sync(timeline, [0.5] * 4) == pytest.approx(0.5)  # stage 3's under stage 0's last Ws


def test_one_stage_per_device_pays_the_last_device_s_sync_past_the_makespan():
    timeline = simulate(build_schedule("1f1b", 2, 4), COSTS)
    ends = [max(t.end for t in timeline.timings(d)) for d in range(2)]
    assert max(ends) == pytest.approx(timeline.makespan) and ends[1] < ends[0]
    # device 1 finishes first: its sync runs under device 0's tail, device 0's after the makespan
    assert exposed_sync(timeline, [1.0, 1.0]) == pytest.approx(1.0)
    assert exposed_sync(timeline, [0.0, timeline.makespan]) == pytest.approx(ends[1])
    assert exposed_sync(timeline, [0.0, 0.0]) == 0.0
