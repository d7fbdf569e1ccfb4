"""Interval arithmetic behind T-Offload's lanes: idle time, p2p transfers, contended progress."""

import pytest

from pipeloom import Costs, build_schedule, simulate
from pipeloom.sim.intervals import finish_time, idle_intervals, link_transfers, merged, overlap


def test_merged_sorts_joins_and_drops_empty():
    assert merged([(3, 4), (0, 1), (1, 2), (5, 5), (3.5, 6)]) == [(0, 2), (3, 6)]


def test_idle_intervals_of_1f1b_are_its_warm_up_and_drain():
    timeline = simulate(build_schedule("1f1b", 2, 1), Costs(F=1, B=2))
    assert idle_intervals(timeline, 0) == [(1, 4)]  # F [0,1], waits for device 1's F and B, BW [4,6]
    assert idle_intervals(timeline, 1) == [(0, 1), (4, 6)]


def test_link_transfers_occupy_both_ends_for_comm():
    timeline = simulate(build_schedule("1f1b", 2, 1), Costs(F=1, B=2, comm=0.5))
    sends, receives = link_transfers(timeline)
    assert sends == [[(1, 1.5)], [(4.5, 5)]] and receives == [[(4.5, 5)], [(1, 1.5)]]
    assert link_transfers(simulate(build_schedule("1f1b", 2, 1), Costs())) == ([[], []], [[], []])


def test_overlap_is_the_length_inside():
    assert overlap(0.5, 5, [(0, 1), (2, 3), (4.5, 9)]) == pytest.approx(0.5 + 1 + 0.5)


@pytest.mark.parametrize(
    "start, work, rate, end",
    [(0, 2, 0.0, 3.5), (0, 2, 0.5, 2.5), (0, 2, 1.0, 2.0), (1.5, 0.5, 0.0, 2.5), (0, 0.5, 0.0, 0.5), (5, 1, 0.0, 6)],
)
def test_finish_time_slows_inside_contended_intervals(start, work, rate, end):
    assert finish_time(start, work, [(1, 2), (2.5, 3)], rate) == pytest.approx(end)
