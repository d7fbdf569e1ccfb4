"""Overlapped F&B pairs in the IR: text and JSON forms, validation, timing, and the cost model."""

import json
import random

import pytest

from pipeloom import ConfigError, Costs, ScheduleError, build_schedule, simulate, validate
from pipeloom.ir.ops import Op, OpKind
from pipeloom.ir.schedule import Schedule
from pipeloom.ir.text import parse_op

TWO_DEVICES = "0F0 0F1 0BW0 0F2&0BW1 0BW2\n1F0 1BW0 1F1 1BW1 1F2 1BW2"


def test_text_form_writes_a_pair_as_one_token_and_reads_it_back():
    schedule = Schedule.from_text(TWO_DEVICES)
    head, tail = schedule.devices[0][3:5]
    assert head == Op(OpKind.F, 0, 2, overlap_next=True) and not tail.overlap_next
    assert schedule.to_text().splitlines()[1] == "0F0 0F1 0BW0 0F2&0BW1 0BW2"
    assert Schedule.from_text(schedule.to_text()).devices == schedule.devices
    assert parse_op("0F2&") == head and str(head) == "0F2&"
    assert "0F2&" in schedule.grid()


def test_json_marks_the_head_and_old_readers_see_two_valid_ops():
    schedule = Schedule.from_text(TWO_DEVICES)
    data = json.loads(json.dumps(schedule.to_dict()))
    assert data["devices"][0][3] == {"op": "F", "stage": 0, "mb": 2, "slice": 0, "ckpt": False, "overlap_next": True}
    assert Schedule.from_dict(data).devices == schedule.devices
    for entry in data["devices"][0]:  # what a reader that ignores the key runs: the same work in order
        entry.pop("overlap_next", None)
    validate(Schedule.from_dict(data))
    bad = json.loads(json.dumps(schedule.to_dict()))
    bad["devices"][0][3]["overlap_next"] = "yes"
    with pytest.raises(ScheduleError, match="'overlap_next' must be true or false"):
        Schedule.from_dict(bad)


@pytest.mark.parametrize(
    "text, message",
    [
        ("0F0 0F1&0F2 0BW0 0BW1 0BW2", "a pair is one forward"),
        ("0F0 0F1 0BW0&0BW1", "a pair is one forward"),
        ("0F0 0F1 0BW0 0BW1&", "is its device's last"),
        ("0F0 0F1&0BW0&0F2 0BW1 0BW2", "not a chain of three"),
        ("0F0 1F0&1BW0 0BW0", "one needs the other's output"),
    ],
)
def test_malformed_pairs_are_refused_by_name(text, message):
    with pytest.raises(ScheduleError, match=message):
        validate(Schedule.from_text(text))


@pytest.mark.parametrize("text", ["0W0&", "0R0&", "0W0&0F1"])
def test_only_forwards_and_backwards_overlap(text):
    with pytest.raises(ScheduleError, match="only a forward or a backward"):
        Schedule.from_text(text)


def test_a_pair_built_in_python_is_checked_too():
    schedule = Schedule.from_text("0F0c 0F1 0R0 0BW0 0BW1")
    ops = list(schedule.devices[0])
    ops[2] = Op(OpKind.R, 0, 0, overlap_next=True)  # R&BW: not a forward and a backward
    with pytest.raises(ScheduleError, match="a pair is one forward"):
        validate(schedule.with_devices([ops]))


def test_a_pair_that_waits_for_itself_across_devices_deadlocks():
    # d0's pair needs 1BW0 (for 0BW0), which needs 1F0, which needs 0F0... and d1 runs 1F0 only
    # after 1BW1, whose forward 1F1 needs 0F1: the pair holds 0F1 back until 0BW0 can start.
    text = "0F0 0F1&0BW0 0BW1\n1F1 1BW1 1F0 1BW0"
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(Schedule.from_text(text))
    validate(Schedule.from_text(text.replace("&", " ")))  # one after the other it runs


def test_pair_ops_start_together_and_end_together():
    timeline = simulate(Schedule.from_text(TWO_DEVICES), Costs(F=1, B=2))
    (head, tail) = list(timeline.timings(0))[3:5]
    assert (head.start, head.end) == (tail.start, tail.end)
    assert head.start == 7  # 0BW1 waits for 1BW1 (ends at 7); 0F2 could start at 6 but waits with it
    assert head.end - head.start == 3  # no communication to hide: F + B


def test_pair_time_hides_each_sides_communication_under_the_other_sides_compute():
    table = Costs(F=1, B=2, W=1, a2a_F=0.5, a2a_B=1.5).resolve(1, 1)
    assert table.F == [1.5] and table.B == [3.5] and table.R == [1.5]  # a lone op waits for its own
    assert table.pair_time(0, 0, fused=False) == pytest.approx(3.5)  # 1 + 2 + max(0, 1.5 − 1)
    assert table.pair_time(0, 0, fused=True) == pytest.approx(4.5)  # + W, which hides nothing more
    big = Costs(F=1, B=1, a2a_F=3, a2a_B=0.5).resolve(1, 1)
    assert big.pair_time(0, 0, fused=False) == pytest.approx(1 + 1 + (3 - 1))
    lone = big.F[0] + big.B[0]
    assert big.pair_time(0, 0, fused=False) == pytest.approx(lone - 1 - 0.5)  # overlap = min(3, 1) + min(0.5, 1)


def test_a2a_scales_like_the_other_per_stage_costs_and_prints_only_when_set():
    table = Costs(F=2, a2a_F=0.6).resolve(2, 4)  # two stages per device: each is half of one device's share
    assert table.a2a_F == [0.3] * 4 and table.F == [1.3] * 4
    assert Costs(a2a_B=[0.2, 0.4]).resolve(2, 2).B == [2.2, 2.4]
    with pytest.raises(ConfigError, match="a2a_B has 2 per-stage values"):
        Costs(a2a_B=[0.2, 0.4]).resolve(2, 4)
    assert "a2a_F" not in Costs().to_dict() and Costs(a2a_B=1).to_dict()["a2a_B"] == 1


def test_pairing_only_adds_constraints_without_communication():
    """With nothing to hide, a pair is never faster than its two ops one after the other, and a
    paired schedule that validates also validates unpaired. Random adjacent F/B pairs over
    generated schedules: the refused ones are refused by name, never by a crash."""
    rng = random.Random(19)
    accepted = refused = 0
    for _ in range(300):
        name = rng.choice(["1f1b", "gpipe", "chimera", "zb-h1", "interleaved"])
        p = rng.choice([2, 4])
        m = rng.choice([2, 4, 8])
        schedule = build_schedule(name, p, m, **({"num_chunks": 2} if name == "interleaved" else {}))
        devices = [list(ops) for ops in schedule.devices]
        for _ in range(rng.randint(1, 4)):
            device = devices[rng.randrange(p)]
            step = rng.randrange(len(device) - 1)
            a, b = device[step], device[step + 1]
            if a.overlap_next or b.overlap_next or (a.kind is OpKind.F) == (b.kind is OpKind.F):
                continue
            if OpKind.W in (a.kind, b.kind) or (step and device[step - 1].overlap_next):
                continue
            device[step] = Op(a.kind, a.stage, a.microbatch, overlap_next=True)
        paired = schedule.with_devices(devices)
        costs = Costs(F=rng.uniform(0.5, 2), B=rng.uniform(0.5, 2), W=rng.uniform(0, 1), comm=rng.choice([0, 0.3]))
        try:
            makespan = simulate(paired, costs).makespan
        except ScheduleError as error:
            assert "deadlock" in error.summary or "cannot overlap" in error.summary
            refused += 1
            continue
        accepted += 1
        assert makespan >= simulate(schedule, costs).makespan - 1e-9
    assert accepted > 100 and refused > 10
