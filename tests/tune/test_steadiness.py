"""Trusting a measurement (`profile.steadiness`): repeated until the median settles, a busy machine
told from an idle one by wall against CPU time — on a fake clock and fake records."""

import math
import random
from types import SimpleNamespace

import pytest

from pipeloom.errors import RuntimeFault
from pipeloom.profile.steadiness import BUSY, Contention, Series, relative_spread, wall_over_cpu
from pipeloom.profile_format import Noise


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


def test_a_median_is_known_no_better_than_its_rounds_agree():
    """Samples tight within each round, the rounds' medians 10 and 12: the machine's speed moved
    between rounds, so the median's error is the rounds' (stdev 2/√2, over √2 rounds, over the
    median 11), not the samples' spread taken as independent draws."""
    series = Series()
    series.add({"F": [10.0, 10.01, 9.99, 10.0]})
    one_round = series.measured()["F"]  # interquartile range 0.005 over 10, four samples
    assert one_round.between == 0.0 and one_round.relative_error == pytest.approx(1.253 / 1.349 * 0.0005 / 2)
    series.add({"F": [12.0, 12.01, 11.99, 12.0]})
    measured = series.measured()["F"]
    assert measured.median == 11.0 and measured.between == pytest.approx(1 / 11)
    within = 1.253 / 1.349 * measured.spread / math.sqrt(8)
    assert within < measured.relative_error == pytest.approx(1 / 11)


def test_relative_spread_is_the_interquartile_range_over_the_median():
    assert relative_spread([1, 2, 3, 4, 5]) == pytest.approx(2 / 3)
    assert relative_spread([7.0]) == 0.0


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


def _results(stretch: float, ranks: int = 2, steps: int = 3):
    """Ranks whose ops (2 ms of CPU each) took `stretch` times that on the wall clock; the first
    step, left out, took ten times."""
    records = []
    for step in range(steps):
        factor = 10 * stretch if step == 0 else stretch
        ops = [(f"F{i}", 0.01 * i, 0.01 * i + 0.002 * factor) for i in range(4)]
        records.append(SimpleNamespace(ops=ops + [("F0&B1", 0.1, 0.2)], op_cpu=[0.002] * 4 + [math.nan]))
    return [SimpleNamespace(records=records) for _ in range(ranks)]


def test_wall_over_cpu_reads_the_stretch_of_the_kept_steps():
    assert wall_over_cpu(_results(1.0)) == pytest.approx(1.0)
    assert wall_over_cpu(_results(1.6)) == pytest.approx(1.6)  # pairs (NaN) and the warm-up step are left out


def test_a_spike_is_dropped_and_a_busy_machine_refused():
    busy = Contention()
    assert busy.clean_round(_results(1.02))
    assert not busy.clean_round(_results(1.5))  # dropped: run again
    assert busy.clean_round(_results(1.01)) and busy.clean_round(_results(1.03))
    noise = busy.described(Noise())
    assert noise.busy_rounds == 1 and noise.wall_over_cpu == pytest.approx(1.02) and noise.busy_limit == busy.busy
    assert not busy.clean_round(_results(1.6)) and not busy.clean_round(_results(1.7))  # 3 busy, 3 clean
    with pytest.raises(RuntimeFault, match=r"this machine is busy: in 4 of 7 probe runs the ops took 1\.6"):
        busy.clean_round(_results(1.9))


def test_a_machine_busy_from_the_start_is_refused_after_three_rounds():
    busy = Contention()
    assert not busy.clean_round(_results(1.9)) and not busy.clean_round(_results(1.9))
    with pytest.raises(RuntimeFault, match="another process is using the cores") as refused:
        busy.clean_round(_results(1.9))
    assert "or pass --allow-busy (PIPELOOM_ALLOW_BUSY=1 for `make demo`) to measure it as it is" in str(refused.value)


def test_allowed_busy_rounds_are_kept_and_said():
    busy = Contention(allow=True)
    assert all(busy.clean_round(_results(2.0)) for _ in range(5)) and busy.clean_round(_results(1.0))
    assert "measured on a busy machine: in 5 of 6 probe runs the ops took 2.00×" in busy.warning()
    assert Contention(allow=True).warning() is None and BUSY < 1.4  # one busy neighbour: 1.4–1.6
