"""The pipeloom.schedule/1 exchange format (DESIGN §1) is read and written exactly."""

import json

import pytest

from pipeloom import FORMAT, Op, OpKind, ScheduleError, build_schedule, load_schedule, simulate
from pipeloom.ir.io import schedule_from_dict
from pipeloom.ir.schedule import Schedule


def test_format_matches_the_design_example(tmp_path):
    schedule = build_schedule("1f1b", num_devices=4, num_microbatches=8)
    path = tmp_path / "s.json"
    schedule.to_json(path)
    data = json.loads(path.read_text())
    assert data["format"] == "pipeloom.schedule/1" == FORMAT
    assert {k: data[k] for k in ("name", "num_devices", "num_stages", "num_microbatches", "num_slices")} == {
        "name": "1f1b",
        "num_devices": 4,
        "num_stages": 4,
        "num_microbatches": 8,
        "num_slices": 1,
    }
    assert data["devices"][0][0] == {"op": "F", "stage": 0, "mb": 0, "slice": 0, "ckpt": False}
    assert data["devices"][3][1] == {"op": "BW", "stage": 3, "mb": 0, "slice": 0}


@pytest.mark.parametrize("name, kwargs", [("gpipe", {}), ("interleaved", {"num_chunks": 2}), ("chimera", {})])
def test_json_round_trip_gives_identical_schedule_and_simulation(tmp_path, name, kwargs):
    schedule = build_schedule(name, num_devices=4, num_microbatches=8, **kwargs)
    path = tmp_path / "s.json"
    schedule.to_json(path)
    again = load_schedule(path)
    assert again == schedule
    assert simulate(again).start == simulate(schedule).start


def test_parts_slices_and_ckpt_round_trip():
    schedule = Schedule.build(
        "odd",
        [
            [
                Op(OpKind.F, 0, 0, 1, ckpt=True),
                Op(OpKind.R, 0, 0, 1, after_grad=True),
                Op(OpKind.B, 0, 0, 1),
                Op(OpKind.W, 0, 0, 1, part=0, parts=2),
                Op(OpKind.W, 0, 0, 1, part=1, parts=2),
            ]
        ],
        num_stages=1,
        num_microbatches=1,
        num_slices=2,
    )
    data = schedule.to_dict()
    assert data["devices"][0][1] == {"op": "R", "stage": 0, "mb": 0, "slice": 1, "after_grad": True}
    assert data["devices"][0][3] == {"op": "W", "stage": 0, "mb": 0, "slice": 1, "part": 0, "parts": 2}
    assert Schedule.from_dict(json.loads(json.dumps(data))) == schedule


def one_device_document(**changes) -> dict:
    """A valid one-stage, one-micro-batch document, with `changes` applied."""
    data = {
        "format": FORMAT,
        "name": "x",
        "num_devices": 1,
        "num_stages": 1,
        "num_microbatches": 1,
        "num_slices": 1,
        "devices": [[{"op": "F", "stage": 0, "mb": 0}, {"op": "BW", "stage": 0, "mb": 0}]],
    }
    data.update(changes)
    return data


def test_reader_ignores_extra_keys_and_defaults_slice_and_ckpt():
    data = one_device_document(
        comment="extra", devices=[[{"op": "F", "stage": 0, "mb": 0, "note": 1}, {"op": "BW", "stage": 0, "mb": 0}]]
    )
    schedule = schedule_from_dict(data)
    assert schedule.devices[0] == (Op(OpKind.F, 0, 0), Op(OpKind.BW, 0, 0))


@pytest.mark.parametrize(
    "change, message",
    [
        ({"format": "pipeloom.schedule/2"}, "unsupported format"),
        ({"num_devices": 3}, "3 op lists"),
        ({"num_stages": 0}, "num_stages must be a positive integer"),
        ({"devices": [[{"op": "Q", "stage": 0, "mb": 0}]]}, "unknown op 'Q'"),
        ({"devices": [[{"op": "F", "stage": -1, "mb": 0}]]}, "'stage' must be a non-negative integer"),
        ({"devices": [[{"op": "B", "stage": 0, "mb": 0, "ckpt": True}]]}, "only a forward"),
        ({"devices": [[{"op": "F", "stage": 0, "mb": 0, "parts": 2}]]}, "only a weight-gradient"),
        ({"devices": [[{"op": "F", "stage": 0, "mb": 0, "after_grad": True}]]}, "only a recompute"),
        ({"devices": [[{"op": "R", "stage": 0, "mb": 0, "after_grad": 1}]]}, "'after_grad' must be true or false"),
    ],
)
def test_malformed_files_are_refused_with_the_reason(change, message):
    with pytest.raises(ScheduleError, match=message):
        schedule_from_dict(one_device_document(**change))


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(ScheduleError, match="cannot read schedule file"):
        load_schedule(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ScheduleError, match="is not JSON"):
        load_schedule(bad)
