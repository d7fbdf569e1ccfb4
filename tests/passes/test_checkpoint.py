"""Mario's passes and driver: Figure 2's steps, Table 1's last column, validity everywhere."""

import random

import pytest

from pipeloom import ConfigError, Costs, InfeasibleError, OpKind, Schedule, build_schedule, simulate, validate
from pipeloom.passes import (
    apply_checkpoint,
    mario,
    overlap_recompute,
    prepose_forward,
    relax_checkpoint,
    remove_redundancy,
    split_backward,
)

FIGURE_2 = Costs(F=1, B=2, R=1)  # t = forward time, backward 2t, recompute t


def checked(schedule):
    validate(schedule)
    return schedule


def makespan(schedule, costs=FIGURE_2):
    return simulate(checked(schedule), costs).makespan


def test_figure_2_step_by_step():
    """p=4, m=4 1F1B: 21 → full checkpoint 28 → overlap 25 → remove redundancy 23 → prepose 22."""
    base = build_schedule("1f1b", 4, 4)
    full = apply_checkpoint(base)
    overlapped = overlap_recompute(full)
    deduplicated = remove_redundancy(overlapped)
    preposed = prepose_forward(deduplicated, FIGURE_2)
    assert [makespan(s) for s in (base, full, overlapped, deduplicated, preposed)] == [21, 28, 25, 23, 22]
    # Every forward but the last device's stays checkpointed: one activation per device at a time.
    assert max(simulate(preposed, FIGURE_2).peak_activation_memory) == 1


def test_figure_2_driver_goes_lower():
    """The driver repeats the passes: after the first prepose, the freed slots let a second prepose
    and the recomputes that follow it close the last gap, so it reaches the baseline's 21 — with one
    activation per device instead of 1F1B's 4, 3, 2, 1."""
    trace = []
    result = mario(build_schedule("1f1b", 4, 4), FIGURE_2, trace=trace)
    timeline = simulate(checked(result), FIGURE_2)
    assert timeline.makespan == 21
    assert timeline.peak_activation_memory == [1, 1, 1, 1]
    steps = [step for step, _, _ in trace]
    assert steps[:4] == ["input", "apply_checkpoint", "overlap_recompute", "remove_redundancy"]
    assert "prepose_forward" in steps
    spans = [span for _, span, _ in trace]
    assert sorted(set(spans), reverse=True) == [28, 25, 23, 22, 21]  # each kept rewrite: no slower
    assert all(later <= earlier for earlier, later in zip(spans[1:], spans[2:]))


def test_full_checkpoint_recomputes_inside_the_backward():
    schedule = apply_checkpoint(build_schedule("1f1b", 2, 2))
    assert schedule.to_text().splitlines()[1:] == [
        "0F0c 0F1c 0R0g 0BW0 0R1g 0BW1",
        "1F0c 1R0g 1BW0 1F1c 1R1g 1BW1",
    ]
    assert Schedule.from_text(schedule.to_text()).devices == schedule.devices
    assert Schedule.from_dict(schedule.to_dict()).devices == schedule.devices


# (name, kwargs, activation memory per device with Mario, in M_B of one device's share)
SHAPES = [("1f1b", {}, 1.0), ("chimera", {}, 1.0), ("interleaved", {"num_chunks": 2}, 0.5)]


@pytest.mark.parametrize("name, kwargs, expected", SHAPES, ids=["V", "X", "W"])
@pytest.mark.parametrize("p", [4, 8])
def test_table_1_last_column(name, kwargs, expected, p):
    """Peak activation memory becomes one stage's activations plus kept inputs: ~M_θ for V and
    X, ~M_θ/2 for W (two chunks per device), balanced across devices."""
    inputs = 0.005  # a stage's input next to its activations (≈ 1 / (34 · layers)); keeps it visible
    costs = Costs(F=1, B=2, R=1, M_ckpt=inputs)
    for m in (p, 2 * p):
        schedule = build_schedule(name, p, m, **kwargs)
        before = simulate(schedule, costs).peak_activation_memory
        peaks = simulate(checked(mario(schedule, costs)), costs).peak_activation_memory
        assert max(peaks) <= expected + 2 * m * inputs + 1e-9, (name, p, m, peaks)
        assert max(peaks) >= expected
        assert max(peaks) / min(peaks) <= 1.25, (name, p, m, peaks)
        assert max(peaks) < max(before) / 2


def test_memory_limit_checkpoints_only_where_short_and_is_kept():
    costs = Costs(F=1, B=2, R=1, M_ckpt=0.01)
    schedule = build_schedule("1f1b", 8, 8)  # peaks 8, 7, ..., 1
    result = mario(schedule, costs, mem_limit=4)
    timeline = simulate(checked(result), costs)
    assert max(timeline.peak_activation_memory) <= 4 + 1e-9
    assert timeline.makespan <= simulate(schedule, costs).makespan * 1.03  # room to hide nearly every recompute
    untouched = [d for d in range(8) if not any(op.ckpt for op in result.devices[d])]
    assert untouched == [4, 5, 6, 7]  # already within 4: never checkpointed
    per_device = mario(schedule, costs, mem_limit=[2, 2, 8, 8, 8, 8, 8, 8])
    assert [any(op.ckpt for op in ops) for ops in per_device.devices] == [True, True] + [False] * 6
    with pytest.raises(InfeasibleError, match="device 0 needs"):
        mario(schedule, costs, mem_limit=0.5)
    with pytest.raises(ConfigError, match="2 memory limits given for 8 devices"):
        mario(schedule, costs, mem_limit=[4, 4])


def test_relax_checkpoint_keeps_activations_where_they_fit():
    costs = Costs(F=1, B=2, R=1)
    full = overlap_recompute(apply_checkpoint(build_schedule("1f1b", 4, 8)))
    relaxed = relax_checkpoint(full, costs, mem_limit=2)
    peaks = simulate(checked(relaxed), costs).peak_activation_memory
    assert max(peaks) <= 2
    assert sum(op.kind is OpKind.R for _, _, op in relaxed.ops()) < sum(op.kind is OpKind.R for _, _, op in full.ops())
    assert relax_checkpoint(full, costs).devices != full.devices  # adjacent F→R on the last device at least


def test_passes_validate_on_every_generator_and_ratio(pick_schedule):
    """Fuzz: generators (fused and split backwards) × sizes × B/F ∈ {1, 1.6, 2}."""
    rng = random.Random(4)
    names = ["gpipe", "1f1b", "interleaved", "chimera", "zb-h1", "zb-h2", "zb-v", "1f1b+split"]
    for case in range(60):
        ratio = rng.choice([1, 1.6, 2])
        costs = Costs(F=1, B=ratio, W=rng.choice([0, 0.3]), R=1, comm=rng.choice([0, 0.05]), M_ckpt=0.02)
        name, schedule = pick_schedule(rng, [n for n in names if n != "1f1b+split"] + ["1f1b"], 6, costs=costs)
        if rng.random() < 0.2:  # a split-backward schedule too
            name, schedule = "1f1b+split", split_backward(schedule, "fill", costs=costs)
        p, m = schedule.num_devices, schedule.num_microbatches
        full = apply_checkpoint(schedule)
        steps = [
            full,
            overlap_recompute(full),
            overlap_recompute(full, costs, into_gaps=True),
            remove_redundancy(full),
            relax_checkpoint(full, costs),
            prepose_forward(overlap_recompute(full), costs),
            mario(schedule, costs),
        ]
        for step in steps:
            validate(step)
        context = (case, name, p, m, ratio)
        assert simulate(steps[1], costs).makespan <= simulate(full, costs).makespan + 1e-9, context
        assert simulate(steps[-1], costs).makespan <= simulate(full, costs).makespan + 1e-9, context
        # (Mario may even beat the input: preposing forwards can reorder a schedule for the better.)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="into_gaps needs the costs"):
        overlap_recompute(apply_checkpoint(build_schedule("1f1b", 2, 2)), into_gaps=True)
