"""torch.distributed.pipelining's CSV action format, both ways."""

import pytest

from pipeloom import ConfigError, Costs, ScheduleError, build_schedule
from pipeloom.ir.torch_csv import PLACEMENTS, check_placement, from_torch_csv, placement_of, stage_ranks, to_torch_csv
from pipeloom.passes import apply_checkpoint, weight_parts


@pytest.mark.parametrize(
    "name, kwargs", [("1f1b", {}), ("zb-h1", {}), ("interleaved", {"num_chunks": 2}), ("zb-v", {})]
)
def test_round_trip(name, kwargs):
    schedule = build_schedule(name, 4, 8, **kwargs)
    back = from_torch_csv(to_torch_csv(schedule), name=name)
    assert back.devices == schedule.devices and back.num_stages == schedule.num_stages


def test_torch_s_interleaved_order_with_idle_cells_and_comms_imports():
    rows = [
        "0F0,0F1,2F0,2F1,,2B0,2B1,0B0,0B1",
        ",1F0,1F1,3F0,3B0,3F1,3B1,1B0,1B1",
    ]
    schedule = from_torch_csv("\n".join(rows) + "\n")
    assert (schedule.num_devices, schedule.num_stages, schedule.num_microbatches) == (2, 4, 2)
    assert to_torch_csv(schedule).splitlines() == [row.replace(",,", ",").strip(",") for row in rows]
    with_comms = "0F0,0SEND_F0,0RECV_B0,0B0,0REDUCE_GRAD\n1RECV_F0,1F0,1B0,1SEND_B0\n"
    assert from_torch_csv(with_comms).to_text().splitlines()[1:] == ["0F0 0BW0", "1F0 1BW0"]
    overlapped = "0F0,0F1,0B0,0B1\n1F0,(1F1;1B0)OVERLAP_F_B,1B1\n"
    assert from_torch_csv(overlapped).to_text().splitlines()[2] == "1F0 1F1&1BW0 1BW1"
    assert to_torch_csv(from_torch_csv(overlapped)) == overlapped


def test_what_torch_cannot_express_is_refused():
    with pytest.raises(ConfigError, match="no recompute action"):
        to_torch_csv(apply_checkpoint(build_schedule("1f1b", 2, 2)))
    with pytest.raises(ConfigError, match="parts"):
        to_torch_csv(weight_parts(build_schedule("1f1b", 2, 2), Costs(W=1), parts=2))
    with pytest.raises(ConfigError, match="slices"):
        to_torch_csv(build_schedule("terapipe", 2, 2, num_slices=2))


@pytest.mark.parametrize(
    "text, error, message",
    [
        ("0F0,0X0\n", ConfigError, "not an action"),
        ("\n", ConfigError, "no compute action"),
        ("0F0,0B0\n1B0,1F0\n", ScheduleError, "not describe a valid schedule"),
        ("0F\n", ConfigError, "names no micro-batch"),
    ],
)
def test_bad_csv(text, error, message):
    with pytest.raises(error, match=message):
        from_torch_csv(text)


def test_placements_are_torch_s_own():
    """Written from torch's `generate_stage_to_rank_mapping` (the planning core imports no torch):
    equal to it wherever torch is here."""
    utils = pytest.importorskip("torch.distributed.pipelining._utils")
    for ranks in range(1, 7):
        for stages in range(1, 4 * ranks + 1):
            for placement in PLACEMENTS:
                if placement == "v" and stages % ranks:
                    with pytest.raises(ConfigError, match="whole rounds"):
                        stage_ranks(ranks, stages, placement)
                    continue
                theirs = utils.generate_stage_to_rank_mapping(ranks, stages, placement)
                assert stage_ranks(ranks, stages, placement) == [theirs[s] for s in range(stages)]


@pytest.mark.parametrize(
    "name, placement",
    [("1f1b", "loop"), ("zb-h1", "loop"), ("zb-auto", "loop"), ("interleaved", "loop")]
    + [("zb-v", "v"), ("v-half", "v"), ("v-min", "v"), ("dualpipev", "v")],
)
def test_each_schedule_sits_in_the_placement_torch_builds_it_in(name, placement):
    schedule = build_schedule(name, 4, 8)
    assert placement_of(schedule) == placement
    check_placement(schedule, placement)
    if schedule.num_stages > schedule.num_devices:  # one stage a rank sits alike in both
        other = "loop" if placement == "v" else "v"
        with pytest.raises(ConfigError, match=f"runs stage \\d+ on rank \\d+, but the {other} placement puts it"):
            check_placement(schedule, other)


@pytest.mark.parametrize("name, instead", [("chimera", "interleaved"), ("dualpipe", "dualpipev")])
def test_two_copies_of_a_stage_are_refused_naming_the_scheme_to_export(name, instead):
    with pytest.raises(ConfigError, match=f"runs stage 0 on ranks .*two copies.* export '{instead}' instead"):
        to_torch_csv(build_schedule(name, 4, 8))
