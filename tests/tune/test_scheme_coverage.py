"""Every registered generator is tuned, or the tuner says why not; every op kind has a cost, a
memory rule, dependencies and a runtime handler — a new one cannot be silently mis-costed."""

import pytest

from pipeloom import Costs, Op, OpKind, Schedule, list_generators
from pipeloom.tune.space import NOT_TUNED, SCHEMES


def test_every_generator_is_tuned_or_says_why_not():
    tuned = {spec.generator for spec in SCHEMES.values()}
    registered = {info.name for info in list_generators()}
    missing = sorted(registered - tuned - set(NOT_TUNED))
    assert not missing, f"generators the tuner neither searches nor excuses in NOT_TUNED: {missing}"
    assert not tuned & set(NOT_TUNED), "a generator is both tuned and excused"
    assert set(NOT_TUNED) <= registered, "NOT_TUNED names a generator that is not registered"
    assert all(reason.strip() for reason in NOT_TUNED.values())


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
