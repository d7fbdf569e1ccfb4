"""Fuzz of `pipeloom simulate` over every generator and flag: each random configuration either is
refused in one line with exit status 2, or is accepted, and then its exported schedule is valid
and its peak activation memory within --mem-limit. No other outcome — no traceback, no silent
breach. Seeded, so a failure reproduces; PIPELOOM_FUZZ=N runs N configurations instead of 200."""

import json
import os
import random

import pytest

from pipeloom.cli import main
from pipeloom.ir.io import load_schedule
from pipeloom.schedules import list_generators

CASES = int(os.environ.get("PIPELOOM_FUZZ", "200"))


def random_configuration(rng: random.Random) -> list[str]:
    generator = rng.choice(list_generators())
    options = generator.options
    p, m = rng.randint(1, 9), rng.randint(1, 20)
    argv = ["simulate", generator.name, "-p", str(p), "-m", str(m)]
    if "num_chunks" in options and rng.random() < 0.7:
        argv += ["-v", str(rng.randint(1, 4))]
    if "num_slices" in options and rng.random() < 0.7:
        argv += ["--slices", str(rng.choice([1, 2, 4]))]
    costs = {key: round(rng.uniform(0.05, 5), 3) for key in ("F", "B", "W")}
    costs.update(comm=rng.choice([0, 0, 0.5, 1.3]), M_B=round(rng.uniform(0.5, 3), 3))
    costs.update(M_W=round(rng.uniform(0, costs["M_B"]), 3), R=round(rng.uniform(0.1, 3), 3))
    if rng.random() < 0.3:
        costs["M_static"] = round(rng.uniform(0, 5), 3)
    if rng.random() < 0.2:
        costs["recompute_fraction"] = round(rng.uniform(0.05, 1), 3)
    flag = rng.random()
    if 0.5 <= flag < 0.55:  # T-Offload's lanes: bytes, rates, a host link shared with p2p or not
        costs.update(offload_bytes=round(rng.uniform(0, 8), 3), reload_bytes=round(rng.uniform(0, 8), 3))
        costs.update(host_bandwidth=round(rng.uniform(0.5, 4), 3), p2p_host_link_share=rng.choice([0, 0.5, 1]))
    argv += ["--costs", ",".join(f"{key}={value}" for key, value in costs.items())]
    if "mem_limit" in options and rng.random() < 0.6:
        limits = [round(rng.uniform(0.5, 4) * costs["M_B"] * p, 3) for _ in range(p)]
        argv += ["--mem-limit", str(limits[0]) if rng.random() < 0.5 else ",".join(map(str, limits))]
    if flag < 0.15:
        argv += ["--split", rng.choice(["after", "deferred", "fill"])]
    elif flag < 0.3:
        argv += ["--weight-parts", str(rng.randint(1, 4))]
    elif flag < 0.4:
        argv += ["--ckpt", rng.choice(["full", "mario"])]
    elif flag < 0.5:
        argv += ["--recompute", rng.choice(["shallow", "0", "1", "0,1"])]
    elif flag < 0.55:
        argv += ["--offload"]
    return argv


def _limits(argv: list[str], p: int) -> list[float] | None:
    if "--mem-limit" not in argv:
        return None
    values = [float(x) for x in argv[argv.index("--mem-limit") + 1].split(",")]
    return values * p if len(values) == 1 else values


def test_every_configuration_is_refused_in_one_line_or_valid_and_within_budget(capsys, tmp_path):
    rng = random.Random(20261123)
    accepted = refused = 0
    for case in range(CASES):
        argv = random_configuration(rng)
        export = tmp_path / "schedule.json"
        export.unlink(missing_ok=True)
        code = main([*argv, "--json", "--export", str(export)])
        out, err = capsys.readouterr()
        if code == 2:
            refused += 1
            assert len(err.strip().splitlines()) == 1 and out == "" and not export.exists(), (case, argv, err)
            continue
        assert code == 0, (case, argv, err)
        accepted += 1
        schedule = load_schedule(export)  # validated on load
        facts = json.loads(out)
        limits = _limits(argv, schedule.num_devices)
        if limits is not None:
            for peak, limit in zip(facts["peak_activation_memory"], limits):
                assert peak <= limit + 1e-9 * max(1.0, limit), (case, argv, peak, limit)
    print(f"fuzz: {CASES} configurations, {accepted} accepted (valid, within budget), {refused} refused in one line")
    assert accepted > CASES / 4 and refused > 0  # the generator reaches both outcomes


@pytest.mark.parametrize("seed", [1, 2])
def test_the_fuzz_configurations_are_reproducible(seed):
    assert random_configuration(random.Random(seed)) == random_configuration(random.Random(seed))
