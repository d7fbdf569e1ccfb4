"""Fuzz: every generator × random valid sizes and costs validates and simulates sensibly, and
random out-of-domain arguments raise ConfigError. A seeded loop: failures reproduce exactly."""

import random

import pytest

from pipeloom import ConfigError, Costs, build_schedule, simulate, validate

CASES = 400


def random_costs(rng: random.Random, num_stages: int) -> Costs:
    def value(low=0.1, high=3.0):
        if rng.random() < 0.3:
            return [round(rng.uniform(low, high), 2) for _ in range(num_stages)]
        return round(rng.uniform(low, high), 2)

    return Costs(
        F=value(), B=value(), W=value(0, 1), comm=rng.choice([0, 0, 0.1, 0.5]), M_B=value(), M_static=value(0, 2)
    )


def random_valid_arguments(rng: random.Random) -> tuple[str, int, int, dict]:
    name = rng.choice(["gpipe", "1f1b", "interleaved", "chimera"])
    p = rng.randint(1, 12)
    m = rng.randint(1, 3 * p)
    kwargs = {}
    if name == "interleaved":
        kwargs["num_chunks"] = rng.randint(1, 4)
        if m > p:
            m -= m % p
    if name == "chimera":
        p += p % 2
        m += m % 2
    return name, p, m, kwargs


def test_generators_validate_and_simulate():
    rng = random.Random(20261121)
    for case in range(CASES):
        name, p, m, kwargs = random_valid_arguments(rng)
        schedule = build_schedule(name, p, m, **kwargs)
        validate(schedule)
        costs = random_costs(rng, schedule.num_stages)
        timeline = simulate(schedule, costs)
        context = (case, name, p, m, kwargs, costs)
        assert timeline.makespan >= max(timeline.busy_time) - 1e-9, context
        assert 0 <= timeline.bubble_rate < 1, context
        for device in range(p):
            curve = [level for _, level in timeline.memory_curve(device)]
            assert max(curve) == pytest.approx(timeline.peak_memory[device]), context
            assert curve[-1] == pytest.approx(timeline.static_memory[device]), context  # everything freed
        assert schedule.num_ops == schedule.num_stages * m * 2, context


def test_out_of_domain_arguments_raise_config_error():
    rng = random.Random(7)
    for _ in range(CASES // 4):
        name = rng.choice(["gpipe", "1f1b", "interleaved", "chimera"])
        p, m = rng.randint(-3, 12), rng.randint(-3, 12)
        kwargs = {"num_chunks": rng.randint(-2, 4)} if name == "interleaved" else {}
        out_of_domain = (
            p < 1
            or m < 1
            or (name == "interleaved" and (kwargs["num_chunks"] < 1 or (m > p and m % p)))
            or (name == "chimera" and (p % 2 or m % 2))
        )
        if out_of_domain:
            with pytest.raises(ConfigError):
                build_schedule(name, p, m, **kwargs)
        else:
            validate(build_schedule(name, p, m, **kwargs))
