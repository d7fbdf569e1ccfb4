"""Forward-only schedules (evaluation): first-class in the IR, the simulator and the file format."""

import pytest

from pipeloom import ScheduleError, build_schedule, simulate
from pipeloom.costs import Costs
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.schedules.forward_only import forward_only_of

TRAINING = [
    ("1f1b", {}),
    ("interleaved", {"num_chunks": 2}),
    ("chimera", {}),
    ("zb-v", {}),
    ("dualpipev", {}),
    ("svpp", {"num_chunks": 2, "num_slices": 2}),
    ("zb-auto", {"mem_limit": 3}),
]


def test_forward_is_gpipe_without_its_backwards_and_keeps_nothing():
    schedule = build_schedule("forward", 3, 4)
    assert schedule.forward_only and schedule.num_ops == 12
    timeline = simulate(schedule, Costs(F=1.0, B=2.0))
    assert timeline.peak_activation_memory == [0.0, 0.0, 0.0]
    assert timeline.makespan == 4 + 2  # the last micro-batch leaves stage 0 at 4 and crosses two more


@pytest.mark.parametrize("name, options", TRAINING)
def test_the_forward_only_twin_of_a_training_schedule_is_valid_and_on_the_same_devices(name, options):
    training = build_schedule(name, 2, 4, **options)
    twin = forward_only_of(training)
    twin.validate()
    assert twin.forward_only and all(op.kind is OpKind.F and not op.ckpt for _, _, op in twin.ops())
    assert [twin.stages_on(d) for d in range(2)] == [training.stages_on(d) for d in range(2)]
    assert max(simulate(twin).peak_activation_memory) == 0.0
    assert simulate(twin).makespan <= simulate(training).makespan


def test_forward_only_round_trips_through_json_and_refuses_backwards(tmp_path):
    schedule = build_schedule("forward", 2, 2)
    schedule.to_json(tmp_path / "f.json")
    from pipeloom.ir.io import load_schedule, schedule_to_dict

    assert load_schedule(tmp_path / "f.json") == schedule
    assert "forward_only" not in schedule_to_dict(build_schedule("1f1b", 2, 2))  # training files are unchanged
    devices = [[Op(OpKind.F, 0, 0), Op(OpKind.BW, 0, 0)], [Op(OpKind.F, 1, 0)]]
    with pytest.raises(ScheduleError, match="forward-only schedule holds 0BW0"):
        Schedule.build("bad", devices, num_stages=2, num_microbatches=1, forward_only=True).validate()
    with pytest.raises(ScheduleError, match="missing backward"):
        Schedule.build("incomplete", [[Op(OpKind.F, 0, 0)]], num_stages=1, num_microbatches=1).validate()
