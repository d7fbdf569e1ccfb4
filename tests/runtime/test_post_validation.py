"""Optimizer post-validation (Zero Bubble §4, appendix C) against synchronous clipping and skipping."""

import pytest

torch = pytest.importorskip("torch")

from pipeloom import ConfigError, build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.layout import RankLayout  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.optimizer_sync import adamw_rollback, decide, step_under  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec  # noqa: E402
from pipeloom.runtime.zero import adamw  # noqa: E402

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)
FAULTS = ((2, 1, "nan", 0.0), (3, 0, "scale", 1000.0))  # a NaN on the last stage, a huge first stage


def test_adamw_rollback_undoes_a_step_in_place():
    torch.manual_seed(0)
    parameter = torch.nn.Parameter(torch.randn(64))
    optimizer = torch.optim.AdamW([parameter], lr=1e-2, weight_decay=0.1)
    for _ in range(3):
        parameter.grad = torch.randn(64)
        optimizer.step()
    before = parameter.detach().clone()
    state = {k: v.clone() for k, v in optimizer.state[parameter].items()}
    parameter.grad = torch.randn(64)
    optimizer.step()
    adamw_rollback(optimizer)
    torch.testing.assert_close(parameter.detach(), before, rtol=1e-6, atol=1e-7)
    for key in ("exp_avg", "exp_avg_sq"):
        torch.testing.assert_close(optimizer.state[parameter][key], state[key], rtol=1e-5, atol=1e-8)
    assert float(optimizer.state[parameter]["step"]) == 3


def state(squares: float, bad: float) -> torch.Tensor:
    return torch.tensor([squares, bad], dtype=torch.float64)


def test_a_rollback_leaves_no_negative_second_moment_where_there_was_none():
    """A weight whose gradients were zero until this step (an expert that just got its first
    tokens) had v = 0: undoing (1 − β2)·g² in floating point leaves about half its elements at
    −1e-16, whose square root the next step turns into NaN. The rollback keeps v at zero."""
    parameter = torch.nn.Parameter(torch.zeros(4096))
    optimizer = adamw([parameter], 1e-2)
    parameter.grad = torch.zeros(4096)
    optimizer.step()
    parameter.grad = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * 1e-3
    optimizer.step()
    adamw_rollback(optimizer)
    second = optimizer.state[parameter]["exp_avg_sq"]
    assert (second >= 0).all() and float(second.max()) < 1e-14  # zero to rounding of (1 − β2)·g² ≈ 1e-9
    optimizer.step()
    assert torch.isfinite(parameter).all()


def test_decisions_are_made_on_the_device():
    assert decide(state(16.0, 0), 5.0).tolist() == [1.0, 1.0]
    stepped, coefficient = decide(state(100.0, 0), 5.0).tolist()
    assert stepped == 1.0 and coefficient == pytest.approx(0.5)
    assert decide(state(1.0, 1), None).tolist() == [0.0, 1.0]
    assert decide(state(float("inf"), 0), 5.0).tolist() == [0.0, 1.0]  # an overflowing sum of squares


def test_a_skipped_step_leaves_weights_moments_and_count_alone():
    parameter = torch.nn.Parameter(torch.randn(64, generator=torch.Generator().manual_seed(0)))
    optimizer = adamw([parameter], lr=1e-2)
    parameter.grad = torch.ones(64)
    optimizer.step()
    before = [parameter.detach().clone(), *(v.clone() for v in optimizer.state[parameter].values())]
    parameter.grad = torch.full((64,), float("nan"))
    step_under(optimizer, decide(state(float("nan"), 1), None))
    after = [parameter.detach(), *optimizer.state[parameter].values()]
    assert all(torch.equal(a, b) for a, b in zip(after, before)) and not hasattr(optimizer, "found_inf")
    parameter.grad = torch.ones(64)
    step_under(optimizer, decide(state(64.0, 0), None))
    assert float(optimizer.state[parameter]["step"]) == 2 and not torch.equal(parameter.detach(), before[0])


@pytest.mark.slow
@pytest.mark.parametrize("name, dp", [("1f1b", 1), ("zb-h1", 2)])
def test_post_validation_equals_synchronous_with_nan_and_clipping(name, dp):
    schedule = build_schedule(name, 2, 4)

    def run(post):
        spec = TrainSpec(
            schedule, config=CONFIG, steps=5, dp=dp, clip_norm=5.0, post_validation=post, gradient_faults=FAULTS
        )
        return run_local(spec)

    synchronous, post = run(False), run(True)
    assert post[0].losses == pytest.approx(synchronous[0].losses, rel=1e-6)
    for rank in range(len(post)):
        assert post[rank].skipped_steps == synchronous[rank].skipped_steps == 1  # the NaN step, everywhere
        for stage, parameters in post[rank].parameters.items():
            for key, value in parameters.items():
                torch.testing.assert_close(value, synchronous[rank].parameters[stage][key], rtol=1e-5, atol=1e-6)
    # device 0 stepped on its partial state twice in vain (NaN downstream, then a norm it could not
    # see whole); the last device always sees the full state
    layout = RankLayout(2, dp)  # ranks are numbered pp × dp × tp
    assert [post[layout.rank(0, d)].rollbacks for d in range(2)] == [2, 0]


@pytest.mark.slow
def test_clipping_that_never_triggers_changes_nothing():
    schedule = build_schedule("1f1b", 2, 4)
    plain = run_in_process(TrainSpec(schedule, config=CONFIG, steps=3))  # the forked ranks' bits, one process
    clipped = run_local(TrainSpec(schedule, config=CONFIG, steps=3, clip_norm=1e6, post_validation=True))
    assert clipped[0].losses == plain[0].losses and [r.rollbacks for r in clipped] == [0, 0]


def test_bad_settings_are_refused():
    schedule = build_schedule("1f1b", 2, 4)
    with pytest.raises(ConfigError, match="must be positive"):
        check_spec(TrainSpec(schedule, config=CONFIG, clip_norm=0))
