"""Each generator: its documented shape, its domain, and its paper's properties."""

import pytest

from pipeloom import ConfigError, Costs, OpKind, build_schedule, list_generators, simulate


def rows(schedule):
    return [" ".join(op.text for op in ops) for ops in schedule.devices]


def test_registry_lists_every_family_with_a_paper():
    names = [g.name for g in list_generators()]
    assert names[:4] == ["gpipe", "1f1b", "interleaved", "chimera"]
    assert all(g.paper and g.domain and g.summary for g in list_generators())


def test_gpipe_shape():
    assert rows(build_schedule("gpipe", 2, 2)) == ["0F0 0F1 0BW0 0BW1", "1F0 1F1 1BW0 1BW1"]


def test_1f1b_shape():
    assert rows(build_schedule("1f1b", 2, 3)) == ["0F0 0F1 0BW0 0F2 0BW1 0BW2", "1F0 1BW0 1F1 1BW1 1F2 1BW2"]


def test_interleaved_shape_and_placement():
    assert rows(build_schedule("interleaved", 2, 2, num_chunks=2)) == [
        "0F0 0F1 2F0 2F1 2BW0 2BW1 0BW0 0BW1",
        "1F0 1F1 3F0 3BW0 3F1 3BW1 1BW0 1BW1",
    ]
    schedule = build_schedule("interleaved", 4, 8, num_chunks=3)
    assert schedule.num_stages == 12
    for device in range(4):
        assert schedule.stages_on(device) == [device, device + 4, device + 8]


def test_interleaved_with_one_chunk_is_1f1b():
    assert build_schedule("interleaved", 4, 8, num_chunks=1).devices == build_schedule("1f1b", 4, 8).devices


def test_chimera_basic_unit_shape():
    assert rows(build_schedule("chimera", 4, 4)) == [
        "0F0 0F1 3F2 3BW2 3F3 3BW3 0BW0 0BW1",
        "1F0 2F2 1F1 2F3 2BW2 1BW0 2BW3 1BW1",
        "1F2 2F0 1F3 2F1 2BW0 1BW2 2BW1 1BW3",
        "0F2 0F3 3F0 3BW0 3F1 3BW1 0BW2 0BW3",
    ]


def test_chimera_places_down_and_up_pipelines():
    schedule = build_schedule("chimera", 6, 12)
    for device in range(6):
        assert schedule.stages_on(device) == sorted({device, 5 - device})
        forwards = [op for op in schedule.devices[device] if op.kind is OpKind.F]
        down = {op.microbatch for op in forwards if op.stage == device}
        up = {op.microbatch for op in forwards if op.stage == 5 - device}
        assert down == {0, 1, 2, 6, 7, 8} and up == {3, 4, 5, 9, 10, 11}


@pytest.mark.parametrize("p", [2, 4, 6, 8, 12, 16])
def test_chimera_basic_unit_has_d_minus_2_bubbles(p):
    """Chimera's claim for its basic unit (N = D, F = B): D−2 bubble slots against 1F1B's 2(D−1)."""
    timeline = simulate(build_schedule("chimera", p, p), Costs(F=1, B=1))
    assert timeline.makespan == 2 * p + (p - 2)
    assert simulate(build_schedule("1f1b", p, p), Costs(F=1, B=1)).makespan == 2 * p + 2 * (p - 1)


@pytest.mark.parametrize("p", [2, 4, 6, 8, 12])
@pytest.mark.parametrize("units", [2, 3, 5])
def test_chimera_keeps_mario_table1_bound_when_units_concatenate(p, units):
    """Mario Table 1: Chimera holds between D/2+1 and D micro-batches per device; concatenating
    units must not add one. `chimera-eager` keeps 1F1B's full warm-up and holds p+1."""
    m = units * p
    bounded = simulate(build_schedule("chimera", p, m), Costs(F=1, B=2))
    eager = simulate(build_schedule("chimera-eager", p, m), Costs(F=1, B=2))
    assert max(bounded.peak_activation_memory) == p
    assert min(bounded.peak_activation_memory) >= p // 2 + 1
    assert max(eager.peak_activation_memory) == p + 1
    # with whole units and no comm the other pipeline fills the slot the shorter warm-up frees
    for costs in (Costs(F=1, B=1), Costs(F=1, B=2)):
        assert (
            simulate(build_schedule("chimera", p, m), costs).makespan
            == simulate(build_schedule("chimera-eager", p, m), costs).makespan
        )


def test_chimera_variants_agree_on_one_unit():
    for p, m in [(4, 4), (8, 8), (8, 4), (6, 2)]:
        assert build_schedule("chimera", p, m).devices == build_schedule("chimera-eager", p, m).devices


def test_chimera_beats_1f1b_on_the_demo_case():
    costs = Costs(F=1, B=2)
    assert (
        simulate(build_schedule("chimera", 8, 16), costs).makespan
        < simulate(build_schedule("1f1b", 8, 16), costs).makespan
    )


@pytest.mark.parametrize(
    "name, p, m, kwargs, message",
    [
        ("interleaved", 4, 6, {}, r"micro-batches \(6\) must be a multiple of the number of devices \(4\)"),
        ("interleaved", 4, 8, {"num_chunks": 0}, r"num_chunks \(v\) must be at least 1"),
        ("interleaved", 4, 8, {"num_chunks": 2.5}, "must be an integer"),
        ("chimera", 3, 4, {}, r"number of devices \(3\) must be even"),
        ("chimera", 4, 3, {}, r"micro-batches \(3\) must be even"),
        ("gpipe", 0, 4, {}, "num_devices must be at least 1"),
        ("1f1b", 4, 0, {}, "num_microbatches must be at least 1"),
        ("1f1b", 4, 4, {"num_chunks": 2}, "does not take num_chunks"),
        ("zb-h9", 4, 4, {}, "unknown schedule 'zb-h9'"),
    ],
)
def test_out_of_domain_arguments_raise_config_error(name, p, m, kwargs, message):
    with pytest.raises(ConfigError, match=message):
        build_schedule(name, p, m, **kwargs)


@pytest.mark.parametrize("name, p, m", [("gpipe", 8, 3), ("1f1b", 8, 1), ("interleaved", 8, 3), ("chimera", 8, 2)])
def test_fewer_microbatches_than_devices(name, p, m):
    timeline = simulate(build_schedule(name, p, m))
    assert timeline.makespan > 0
