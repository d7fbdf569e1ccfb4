"""The compact text form round-trips (reference: torch.distributed.pipelining's "2F0" actions)."""

import pytest

from pipeloom import Op, OpKind, ScheduleError, build_schedule, parse_op, simulate
from pipeloom.ir.schedule import Schedule


@pytest.mark.parametrize(
    "text, op",
    [
        ("2F0", Op(OpKind.F, 2, 0)),
        ("0BW13", Op(OpKind.BW, 0, 13)),
        ("1B4", Op(OpKind.B, 1, 4)),
        ("12R7", Op(OpKind.R, 12, 7)),
        ("12R7g", Op(OpKind.R, 12, 7, after_grad=True)),
        ("1R0.1g", Op(OpKind.R, 1, 0, slice=1, after_grad=True)),
        ("3F1c", Op(OpKind.F, 3, 1, ckpt=True)),
        ("3F1.2", Op(OpKind.F, 3, 1, slice=2)),
        ("3F1.2c", Op(OpKind.F, 3, 1, slice=2, ckpt=True)),
        ("0W5:1/3", Op(OpKind.W, 0, 5, part=1, parts=3)),
        ("4W2.1:0/2", Op(OpKind.W, 4, 2, slice=1, part=0, parts=2)),
    ],
)
def test_op_text_round_trip(text, op):
    assert parse_op(text) == op
    assert op.text == text
    assert str(op) == text


@pytest.mark.parametrize(
    "text", ["", "F0", "2X0", "2F", "2BWc0", "2Bc0", "2F0:0/2", "2W0:3/3", "-1F0", "2f0", "2F0g", "2R0gc"]
)
def test_bad_op_text_is_rejected_with_the_text(text):
    with pytest.raises(ScheduleError) as error:
        parse_op(text)
    assert repr(text.strip()) in str(error.value)


@pytest.mark.parametrize(
    "name, p, m, kwargs",
    [("gpipe", 3, 5, {}), ("1f1b", 4, 7, {}), ("interleaved", 4, 8, {"num_chunks": 3}), ("chimera", 4, 6, {})],
)
def test_schedule_text_round_trip_is_identical_and_simulates_identically(name, p, m, kwargs):
    schedule = build_schedule(name, num_devices=p, num_microbatches=m, **kwargs)
    again = Schedule.from_text(schedule.to_text())
    assert again == schedule
    first, second = simulate(schedule), simulate(again)
    assert (first.start, first.end, first.peak_memory) == (second.start, second.end, second.peak_memory)


def test_text_without_header_infers_sizes():
    schedule = Schedule.from_text("0F0 0F1 0BW0 0BW1\n1F0 1BW0 1F1 1BW1\n", name="mine")
    assert (schedule.name, schedule.num_devices, schedule.num_stages, schedule.num_microbatches) == ("mine", 2, 2, 2)
    assert schedule == build_schedule("1f1b", 2, 2).with_devices(schedule.devices, name="mine")


def test_empty_device_line_round_trips():
    schedule = Schedule.build("idle", [[Op(OpKind.F, 0, 0), Op(OpKind.BW, 0, 0)], []], num_stages=1, num_microbatches=1)
    assert Schedule.from_text(schedule.to_text()) == schedule


def test_grid_shows_every_device_and_step():
    grid = build_schedule("1f1b", 2, 3).grid()
    assert grid.splitlines() == [
        "step  0     1     2     3     4     5",
        "d0  0F0   0F1   0BW0  0F2   0BW1  0BW2",
        "d1  1F0   1BW0  1F1   1BW1  1F2   1BW2",
    ]


def test_grid_of_a_large_schedule_shows_a_window_around_the_marks():
    schedule = build_schedule("1f1b", 64, 256)
    grid = schedule.grid({(40, 300)})
    assert "[40F" in grid or "[40BW" in grid
    assert "…" in grid
    assert len(grid.splitlines()) < 10
    assert max(len(line) for line in grid.splitlines()) < 160
