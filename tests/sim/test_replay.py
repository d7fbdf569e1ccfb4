"""Replaying a run's own op times separates a profile's error from the runtime's."""

from types import SimpleNamespace

import pytest

from pipeloom import Costs, build_schedule
from pipeloom.sim.replay import replay, replay_records
from pipeloom.sim.simulate import simulate

COSTS = Costs(F=1.0, B=2.0, W=0.0, comm=0.1)


def _records(schedule, costs, idle=0.0, steps=3):
    """Each device's ops as a run under `costs` would record them, with `idle` ms of the
    runtime's own before every op (pushing the device's later ops back)."""
    timeline = simulate(schedule, costs)
    out = []
    for device, ops in enumerate(schedule.devices):
        clock, rows = 0.0, []
        offset = sum(len(o) for o in schedule.devices[:device])
        for step, op in enumerate(ops):
            g = offset + step
            clock = max(clock, timeline.start[g]) + idle
            rows.append((op.text, clock, clock + timeline.end[g] - timeline.start[g]))
            clock = rows[-1][2]
        out.append([rows] * steps)
    return out


def test_a_run_as_predicted_replays_to_the_prediction():
    schedule = build_schedule("1f1b", 4, 8)
    result = replay(schedule, COSTS, _records(schedule, COSTS))
    assert result.replayed == pytest.approx(result.predicted) == pytest.approx(simulate(schedule, COSTS).makespan)
    assert result.kinds == pytest.approx({"F": 0.0, "BW": 0.0})
    assert result.measured == pytest.approx(result.predicted)


def test_slower_ops_show_as_op_time_error_and_alike_as_the_machine():
    schedule = build_schedule("1f1b", 4, 8)
    result = replay(schedule, COSTS, _records(schedule, Costs(F=1.1, B=2.2, W=0.0, comm=0.1)))
    assert result.kinds == pytest.approx({"F": 0.1, "BW": 0.1})
    assert result.drift == pytest.approx(0.1)
    # 10 % dearer ops, comm unchanged: the replay is at most 10 % longer, and what the run measured
    assert result.predicted < result.replayed <= 1.1 * result.predicted + 1e-9
    assert result.measured == pytest.approx(result.replayed)  # the ops explain the whole run
    text = result.explain(result.measured)
    assert "the machine ran 10% slower than while profiled" in text and "BW +10%, F +10%" in text
    uneven = replay(schedule, COSTS, _records(schedule, Costs(F=1.3, B=1.9, W=0.0, comm=0.1)))
    assert uneven.drift is None and "alike" not in uneven.explain(uneven.measured)


def test_time_the_ops_do_not_explain_is_the_runtime_s():
    schedule = build_schedule("zb-h1", 2, 4)
    costs = Costs(F=1.0, B=1.0, W=1.0, comm=0.0)
    result = replay(schedule, costs, _records(schedule, costs, idle=0.05))
    assert result.replayed == pytest.approx(result.predicted)  # the ops took what was predicted
    assert result.measured > result.replayed + 0.05 * len(schedule.devices[0]) - 1e-9  # idle before each op
    assert "runtime +" in result.explain(result.measured) and "idle beyond" in result.explain(result.measured)


def test_the_runtime_s_time_around_each_op_is_not_read_as_op_time():
    """A plan prices the runtime's per-op overhead inside each op; a run times it between them."""
    schedule = build_schedule("zb-h1", 2, 4)
    plain = Costs(F=1.0, B=1.0, W=1.0, comm=0.0)
    result = replay(schedule, Costs(F=1.0, B=1.0, W=1.0, comm=0.0, op_overhead=0.05), _records(schedule, plain))
    assert result.kinds == pytest.approx({"F": 0.0, "B": 0.0, "W": 0.0})  # the ops took what was predicted
    assert result.replayed == pytest.approx(result.predicted)
    assert result.measured < result.replayed  # this run spent nothing around its ops


def test_a_w_in_parts_is_compared_without_its_share_of_the_runtime_s_time_around_it():
    """A W in 7 parts prices each part at 1/7 of the W, the per-op overhead included: a run whose
    parts took their seventh of the W's compute reads as predicted (each part had been compared
    less a whole op's overhead: W +449 % on a bf16 profile)."""
    from pipeloom.passes.weight_parts import weight_parts

    priced = Costs(F=1.0, B=1.0, W=1.4, comm=0.0, op_overhead=0.1)
    schedule = weight_parts(build_schedule("zb-h1", 2, 4), priced)
    assert {op.parts for ops in schedule.devices for op in ops if op.kind.value == "W"} == {7}
    plain = Costs(F=1.0, B=1.0, W=1.4, comm=0.0)  # the ops alone
    result = replay(schedule, priced, _records(schedule, plain))
    assert result.kinds == pytest.approx({"F": 0.0, "B": 0.0, "W": 0.0})
    assert result.replayed == pytest.approx(result.predicted)


def test_ops_that_vary_from_step_to_step_cost_a_pipeline_more_than_their_medians():
    schedule = build_schedule("1f1b", 2, 4)
    slow = Costs(F=1.5, B=3.0, W=0.0, comm=0.1)
    # device 0 slow in steps 1 and 3, device 1 in 0 and 2: each device's median op is the plain one
    steps = [[], []]
    for k in range(5):
        for device in range(2):
            costs = slow if k in ((1, 3), (0, 2))[device] else COSTS
            steps[device].append(_records(schedule, costs)[device][0])
    result = replay(schedule, COSTS, steps)
    assert result.replayed == pytest.approx(result.predicted)  # the medians are the plain ops
    assert result.stepwise > result.replayed + 0.5  # every step waits for its slow device
    assert "their variation +" in result.explain(result.measured)


def test_a_w_run_inside_its_b_still_reads_as_the_machine_s_speed():
    """Where nothing waits for a B the runtime runs its W inside it: the run times a B as long as
    both and no W, and the backward's passes, judged together, moved alike with the F."""
    schedule = build_schedule("zb-h1", 2, 4)
    costs = Costs(F=1.0, B=1.0, W=1.0, comm=0.0)
    slower = _records(schedule, Costs(F=1.1, B=2.2, W=0.0, comm=0.0))  # every W folded into its B, 10 % slower
    steps = [[[op for op in ops if "W" not in op[0]] for ops in device] for device in slower]  # no W timed
    result = replay(schedule, costs, steps)
    assert result.kinds["W"] == pytest.approx(-1.0) and result.kinds["B"] == pytest.approx(1.2)
    assert result.passes == pytest.approx({"F": 0.1, "B+W": 0.1})
    assert result.drift == pytest.approx(0.1)
    assert "B+W +10%, F +10% against the profile; every op kind slower alike" in result.explain(result.measured)


def test_a_run_s_records_are_replayed_on_one_clock():
    """Each step's devices from the first of them to begin: device 1 began its step 2 ms after
    device 0, and its ops' own times count from there."""
    schedule = build_schedule("1f1b", 2, 1)
    per_device = _records(schedule, COSTS, steps=2)
    steps = [
        [
            SimpleNamespace(
                began=10.0 + 0.002 * d,
                ops=[(t, (a - 2.0 * d) / 1e3, (b - 2.0 * d) / 1e3) for t, a, b in per_device[d][k]],
            )
            for d in range(2)
        ]
        for k in range(2)
    ]
    result = replay_records(schedule, COSTS, steps)
    assert result.measured == pytest.approx(simulate(schedule, COSTS).makespan)
    assert result.replayed == pytest.approx(result.predicted)
