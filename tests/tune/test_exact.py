"""CP-SAT exact mode (appendix G): as good as the heuristic it starts from, within memory."""

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate
from pipeloom.schedules.auto_search import auto_schedule
from pipeloom.schedules.v_shape import v_placement

pytest.importorskip("ortools")

from pipeloom.tune.exact import placement_of, solve_exact  # noqa: E402


@pytest.mark.parametrize(
    "costs, limit",
    [
        (Costs(F=1, B=1.2, W=0.8, comm=0.05, M_W=0.5), 4),  # 1F1B's memory: ZB-1p's regime
        (Costs(F=1.2, B=1, W=0.6, comm=0.1, M_W=0.4), 6),
    ],
)
def test_exact_is_at_least_as_good_as_the_heuristic_on_p4_m8(costs, limit):
    p, m = 4, 8
    heuristic = build_schedule("zb-auto", p, m, costs=costs, mem_limit=limit)
    result = solve_exact(list(range(p)), m, costs, limit, hint=heuristic, time_limit=20)
    validate(result.schedule)
    timeline = simulate(result.schedule, costs)
    assert result.cost == pytest.approx(timeline.cost)
    assert result.cost <= simulate(heuristic, costs).cost + 1e-6
    assert result.hint_cost == pytest.approx(simulate(heuristic, costs).cost)
    assert max(timeline.peak_activation_memory) <= limit + 1e-9
    assert result.bound <= result.cost + 1e-3 and 0 <= result.gap < 1
    assert result.bound >= m * (costs.F + costs.B + costs.W) - 1e-3  # no device beats its own work


def test_exact_proves_zb_h1_optimal_at_1f1b_memory_for_equal_times():
    """T_F = T_B = T_W, limit p·M_B (M_W = 0): nothing beats ZB-H1's (p−1)(T_F+T_B−T_W) bubble."""
    costs = Costs(F=1, B=1, W=1)
    result = solve_exact(list(range(4)), 8, costs, 4, hint=build_schedule("zb-h1", 4, 8), time_limit=20)
    assert result.status == "OPTIMAL" and result.gap == 0
    assert result.cost == pytest.approx(8 * 3 + 3 * (1 + 1 - 1))


def test_exact_handles_v_placements():
    costs = Costs(F=1, B=1, W=1, M_W=0.25)
    heuristic = auto_schedule("v", v_placement(2), 4, costs, 2)
    assert heuristic is not None
    result = solve_exact(v_placement(2), 4, costs, 2, hint=heuristic.schedule, time_limit=10)
    validate(result.schedule)
    assert result.cost <= heuristic.cost + 1e-6


def test_placement_of_refuses_replicated_stages():
    assert placement_of(build_schedule("zb-v", 3, 6)) == [0, 1, 2, 2, 1, 0]
    with pytest.raises(ConfigError, match="replicated"):
        placement_of(build_schedule("chimera", 4, 4))


def test_exact_refuses_bad_arguments():
    with pytest.raises(ConfigError, match="time limit"):
        solve_exact([0, 1], 2, Costs(), None, time_limit=0)


def test_exact_refuses_overlapped_pairs_it_cannot_model():
    """DualPipeV's F&B pairs hide each other's all-to-alls: ordered one op at a time, the
    "optimum" (10) was slower than the paired schedule it started from (9)."""
    from pipeloom.tune.exact import optimise_schedule

    costs = Costs(F=1, B=1, W=1, a2a_F=1, a2a_B=1)
    with pytest.raises(ConfigError, match="cannot model overlapped F&B pairs"):
        optimise_schedule(build_schedule("dualpipev", 1, 2, costs=costs), costs)
