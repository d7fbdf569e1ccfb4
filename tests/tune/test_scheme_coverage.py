"""Every registered generator is tuned, or the tuner says why not; every op kind has a cost, a
memory rule, dependencies and a runtime handler — a new one cannot be silently mis-costed."""

import pytest

from pipeloom import Costs, Op, OpKind, Schedule, list_generators
from pipeloom.schedules.registry import Tuning, register  # noqa: I001
from pipeloom.tune.space import DEFAULT_SCHEMES, GENERATOR_OF, SCHEMES


def test_every_generator_is_tuned_or_says_why_not():
    for info in list_generators():
        assert (info.tuning is None) != (not info.not_tuned), info.name
    tuned = {info.name for info in list_generators() if info.tuning is not None}
    assert set(GENERATOR_OF.values()) == tuned and set(DEFAULT_SCHEMES) <= set(SCHEMES)


def test_registering_a_generator_without_a_tuner_description_fails():
    with pytest.raises(RuntimeError, match="give tuning= or not_tuned='why', exactly one"):
        register("undescribed", family="x", paper="x", summary="x", domain="x")
    with pytest.raises(RuntimeError, match="exactly one"):
        register("both", family="x", paper="x", summary="x", domain="x", tuning=Tuning("both"), not_tuned="why")


def test_layouts_place_every_stage_once_per_copy():
    for tuning in SCHEMES.values():
        for p in (1, 2, 4):
            chunks = max(tuning.chunks)
            hosted = [s for stages in tuning.stages_on(p, chunks) for s in stages]
            stages = tuning.num_stages(p, chunks)
            assert sorted(hosted) == sorted(list(range(stages)) * tuning.replicas), (tuning.scheme, p)


@pytest.mark.parametrize("kind", list(OpKind))
def test_every_op_kind_has_a_cost_and_a_memory_rule(kind):
    table = Costs(F=1, B=2, W=0.5, R=1, M_B=1, M_W=0.25, M_ckpt=0.1).resolve(1, 1, 1)
    op = Op(kind, 0, 0)
    assert table.duration(op) >= 0
    assert isinstance(table.memory_delta(op), float)


@pytest.mark.parametrize("kind", list(OpKind))
def test_every_op_kind_has_dependencies(kind):
    """A one-stage schedule with one op of each kind its key needs builds a graph (validate)."""
    from pipeloom import validate

    ops = {
        OpKind.F: "0F0 0BW0",
        OpKind.BW: "0F0 0BW0",
        OpKind.B: "0F0 0B0 0W0",
        OpKind.W: "0F0 0B0 0W0",
        OpKind.R: "0F0c 0R0 0BW0",
    }[kind]
    validate(Schedule.from_text(ops))


def test_a_kind_no_rule_knows_fails_loudly():
    """Not costed as some other kind: the rules end in assert_never (which mypy also checks)."""
    table = Costs().resolve(1, 1)
    with pytest.raises(AssertionError):
        table.time_of("X", 0)  # type: ignore[arg-type]
    with pytest.raises(AssertionError):
        table.delta_of("X", 0)  # type: ignore[arg-type]
