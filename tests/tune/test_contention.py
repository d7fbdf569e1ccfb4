"""A busy machine is told from an idle one by wall against CPU time, on fake records."""

import math
from types import SimpleNamespace

import pytest

from pipeloom.errors import RuntimeFault
from pipeloom.profile.contention import BUSY, Contention, wall_over_cpu
from pipeloom.profile_format import Noise


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
