"""Trusting a measurement: warm-up left out, repeated until the median settles — on a fake clock."""

import random

import pytest

from pipeloom.profile.stability import Series, relative_spread


def until_stable(run_round, floor: float = 0.0, max_rounds: int = 4):
    """Rounds of `run_round()` into one series, as the probe runner adds them, until it settles."""
    series = Series(floor=floor)
    while series.rounds < max_rounds and not series.add(run_round()):
        pass
    return series.measured()


class FakeClock:
    """Rounds of op times: `slow` warm-up ms on top for the first rounds, then `base` ± noise."""

    def __init__(self, base: float, noise: float, slow_rounds: int = 0, slow: float = 0.0, seed: int = 0):
        self.base, self.noise, self.slow_rounds, self.slow = base, noise, slow_rounds, slow
        self.rng, self.rounds = random.Random(seed), 0

    def __call__(self):
        extra = self.slow if self.rounds < self.slow_rounds else 0.0
        self.rounds += 1
        return {"F": [self.base + extra + self.rng.uniform(-self.noise, self.noise) for _ in range(12)]}


def test_a_quiet_machine_is_trusted_after_one_repeat():
    clock = FakeClock(10.0, 0.01)
    measured = until_stable(clock)["F"]
    assert clock.rounds == 2 and measured.stable and measured.rounds == 2
    assert measured.median == pytest.approx(10.0, abs=0.01) and measured.spread < 0.01


def test_a_busy_spell_is_outvoted_by_repeats():
    clock = FakeClock(10.0, 0.05, slow_rounds=1, slow=5.0)  # the first round ran 50 % slow
    measured = until_stable(clock, max_rounds=6)["F"]
    assert measured.stable and 3 <= clock.rounds <= 6
    assert measured.median == pytest.approx(10.0, abs=0.1)  # the median of all rounds, not the first


def test_a_noisy_machine_runs_out_of_rounds_and_says_so():
    clock = FakeClock(10.0, 1.0, seed=3)
    drifting = iter(range(100))

    def drift():  # each round 20 % slower than the last
        k = next(drifting)
        return {"F": [v * 1.2**k for v in clock()["F"]]}

    measured = until_stable(drift, max_rounds=4)["F"]
    assert not measured.stable and measured.rounds == 4 and measured.samples == 48
    assert measured.spread > 0.2


def test_small_quantities_settle_by_the_floor():
    rounds = iter([[0.010, 0.030, 0.011, 0.029], [0.020, 0.021, 0.019, 0.022]])
    measured = until_stable(lambda: {"allreduce": next(rounds)}, floor=0.1)["allreduce"]
    assert measured.stable and measured.rounds == 2


def test_relative_spread_is_the_interquartile_range_over_the_median():
    assert relative_spread([1, 2, 3, 4, 5]) == pytest.approx(2 / 3)
    assert relative_spread([7.0]) == 0.0


def _fits(per_layer_by_size):
    from pipeloom.profile_format import Fit

    return {size: {kind: Fit(value, 0.0) for kind in ("F", "B", "W")} for size, value in per_layer_by_size}


def test_a_larger_micro_batch_cheaper_per_sample_beyond_noise_is_suspect():
    from pipeloom.profile.stability import falling_per_sample

    assert falling_per_sample(_fits([(1, 1.0), (2, 2.0), (4, 4.1)]), noise=0.03) == []  # per sample: flat or up
    assert falling_per_sample(_fits([(1, 1.0), (2, 1.96)]), noise=0.03) == []  # 2 % cheaper: within noise
    assert falling_per_sample(_fits([(1, 1.0), (2, 1.6), (4, 3.2)]), noise=0.03) == [1, 2]  # mbs 2: 20 % cheaper
    (warning,) = falling_per_sample(_fits([(1, 1.0), (2, 1.6)]), noise=0.03, describe=True)
    assert "micro-batch 1 to" in warning and "at 2" in warning


@pytest.mark.parametrize("overhead", [0.0, 0.2, -0.1])
def test_the_per_op_overhead_is_what_makes_the_simulated_pipeline_the_measured_one(overhead):
    from pipeloom.costs import Costs
    from pipeloom.profile.overheads import linear_fit, op_overhead_ms, with_op_overhead
    from pipeloom.schedules import build_schedule
    from pipeloom.sim.simulate import simulate

    costs, schedule = Costs(F=[1.0, 1.2], B=[2.0, 2.0], W=[0.5, 0.5], comm=0.1), build_schedule("zb-h1", 2, 4)
    measured = simulate(schedule, with_op_overhead(costs, overhead)).makespan
    assert op_overhead_ms(schedule, costs, measured) == pytest.approx(overhead, abs=1e-9)
    assert linear_fit([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
