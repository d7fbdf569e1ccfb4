"""Validation (DESIGN §1): incomplete, misplaced and deadlocking schedules are rejected with
messages that name the offending ops, and the grid marks them."""

import pytest

from pipeloom import ScheduleError, build_schedule, simulate, validate
from pipeloom.ir.schedule import Schedule


def rejection(text: str) -> ScheduleError:
    schedule = Schedule.from_text(text, name="hand-made")
    with pytest.raises(ScheduleError) as error:
        validate(schedule)
    with pytest.raises(ScheduleError):
        simulate(schedule)  # the simulator refuses the same schedules
    return error.value


def test_generated_schedules_validate():
    for name, kwargs in [("gpipe", {}), ("1f1b", {}), ("interleaved", {"num_chunks": 2}), ("chimera", {})]:
        graph = validate(build_schedule(name, 4, 8, **kwargs))
        assert graph.num_ops == 4 * 8 * 2 * (2 if name == "interleaved" else 1)


def test_deadlock_names_the_cycle():
    # d0 waits for 1BW0, which d1 runs only after 1F1, which needs 0F1, which d0 runs only after 0BW0.
    error = rejection("0F0 0BW0 0F1 0BW1\n1F1 1BW1 1F0 1BW0")
    assert error.summary.startswith("deadlock in schedule 'hand-made'")
    for part in (
        "0BW0 (device 0, step 1) waits for 1BW0 (device 1, step 3)",
        "queued behind 1F1 (device 1, step 0)",
        "1F1 (device 1, step 0) waits for 0F1 (device 0, step 2)",
        "queued behind 0BW0 (device 0, step 1)",
    ):
        assert part in error.summary
    assert "\n" not in error.summary
    assert "[0BW0]" in error.details and "[1F1]" in error.details and "[0F1]" in error.details
    assert "[1BW0]" in error.details


def test_deadlock_on_one_device():
    error = rejection("0BW0 0F0")
    assert "0BW0 (device 0, step 0) waits for 0F0 (device 0, step 1)" in error.summary


def test_missing_w_is_named():
    error = rejection("0F0 0B0 0W0 0F1 0B1\n1F0 1BW0 1F1 1BW1")
    assert "missing W for 0B1" in error.summary
    assert "[0B1]" in error.details


def test_duplicated_f_is_named():
    error = rejection("0F0 0F1 0F1 0BW0 0BW1\n1F0 1BW0 1F1 1BW1")
    assert "duplicated F of key (stage 0, mb 1)" in error.summary
    assert "[0F1]" in error.details


def test_backward_on_another_device_is_named():
    error = rejection("0F0 0BW0 1BW0\n1F0")
    assert "1BW0 runs on device 0 but 1F0 ran on device 1" in error.summary
    assert "[1BW0]" in error.details and "[1F0]" in error.details


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0 0BW0\n1F0", "missing backward (B or BW) for 1F0"),
        ("0BW0\n1F0 1BW0", "missing forward 0F0"),
        ("0F0c 0BW0", "missing R for checkpointed 0F0c"),
        ("0F0 0R0 0BW0", "0R0 recomputes 0F0, which is not checkpointed"),
        ("0F0 0BW0 0W0", "0BW0 is a fused backward but W ops also exist"),
        ("0F0 0B0 0W0:0/2 0W0:0/2", "duplicated W part 0/2"),
        ("0F0 0B0 0W0:0/3 0W0:1/3", "missing W part(s) [2] of 3 for 0B0"),
        ("0F0 0B0 0W0:0/2 0W0:1/3", "disagree on their number of parts"),
        ("0F0 0BW0 0BW0", "duplicated backward (B/BW) of key (stage 0, mb 0)"),
    ],
)
def test_incomplete_schedules_are_named(text, message):
    assert message in str(rejection(text))


def test_out_of_range_op_is_named():
    schedule = Schedule.from_text("# pipeloom name=x stages=1 microbatches=1 slices=1\n0F0 0BW0 1F0")
    with pytest.raises(ScheduleError, match="1F0 is out of range: the schedule has 1 stages"):
        validate(schedule)


def test_every_problem_is_listed_and_the_summary_stays_one_line():
    error = rejection("0F0 0F0 0B0\n1F0 1BW0 1BW0")
    assert "(and " in error.summary and "\n" not in error.summary
    assert error.details.count("\n- ") >= 2


def test_schedule_refuses_inconsistent_sizes():
    with pytest.raises(ScheduleError, match="num_devices is 3 but 2 device lists"):
        Schedule("x", 3, 2, 1, 1, ((), ()))
    with pytest.raises(ScheduleError, match="num_microbatches must be a positive integer"):
        Schedule("x", 1, 1, 0, 1, ((),))


def test_slices_follow_causal_order():
    # Slice 1's forward needs slice 0's keys/values on the same stage: running it first deadlocks.
    error = rejection("0F0.1 0F0 0BW0.1 0BW0")
    assert "0F0.1 (device 0, step 0) waits for 0F0 (device 0, step 1)" in error.summary
    # Backward of slice 0 needs slice 1's backward (gradients into its keys/values).
    error = rejection("0F0 0F0.1 0BW0 0BW0.1")
    assert "0BW0 (device 0, step 2) waits for 0BW0.1 (device 0, step 3)" in error.summary
