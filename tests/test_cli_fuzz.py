"""Fuzz of `pipeloom simulate` over every generator and flag: each random configuration either is
refused in one line with exit status 2, or is accepted, and then its exported schedule is valid
and its peak activation memory within --mem-limit. No other outcome — no traceback, no silent
breach. Costs reach M_W up to 2·M_B; a fifth of the configurations read a schedule file whose rows
fuse random neighbours into overlapped pairs, forward-first or backward-first. Seeded, so a failure
reproduces; PIPELOOM_FUZZ=N runs N configurations instead of 120, PIPELOOM_FUZZ_SEED=S another seed."""

import json
import os
import random
import re
from pathlib import Path

import pytest

from pipeloom import build_schedule
from pipeloom.cli import main
from pipeloom.ir.io import load_schedule
from pipeloom.ir.torch_csv import to_torch_csv
from pipeloom.schedules import list_generators

CASES = int(os.environ.get("PIPELOOM_FUZZ", "120"))
SEED = int(os.environ.get("PIPELOOM_FUZZ_SEED", "20261123"))
_PAIRABLE = re.compile(r"^\d+[FIB]\d+$")


def random_configuration(rng: random.Random, directory: Path) -> list[str]:
    generator = rng.choice(list_generators())
    options = generator.options
    p, m = rng.randint(1, 9), rng.randint(1, 20)
    argv = ["simulate", generator.name, "-p", str(p), "-m", str(m)]
    if "num_chunks" in options and rng.random() < 0.7:
        argv += ["-v", str(rng.randint(1, 4))]
    if "num_slices" in options and rng.random() < 0.7:
        argv += ["--slices", str(rng.choice([1, 2, 4]))]
    if rng.random() < 0.2:
        argv = ["simulate", "--schedule-file", _paired_schedule_file(rng, directory)]
        options = ("mem_limit",)  # taken with --ckpt mario or its passes, refused in one line without
        if rng.random() < 0.3:
            argv += ["--passes", rng.choice(["apply-checkpoint,relax-checkpoint", "relax-checkpoint"])]
    costs = {key: round(rng.uniform(0.05, 5), 3) for key in ("F", "B", "W")}
    costs.update(comm=rng.choice([0, 0, 0.5, 1.3]), M_B=round(rng.uniform(0.5, 3), 3))
    costs.update(M_W=round(rng.uniform(0, 2 * costs["M_B"]), 3), R=round(rng.uniform(0.1, 3), 3))
    if rng.random() < 0.3:
        costs.update(a2a_F=round(rng.uniform(0, 1), 3), a2a_B=round(rng.uniform(0, 1), 3))
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


def _paired_schedule_file(rng: random.Random, directory: Path) -> str:
    """A generated schedule in torch's CSV with random neighbouring compute actions fused into
    overlapped pairs in whichever order they stood: some valid, some deadlocked or malformed."""
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved", "dualpipev"])
    p = rng.randint(1, 4)
    m = rng.randint(max(1, 2 * p - 1) if name == "dualpipev" else 1, 3 * p + 2)
    if name == "interleaved" and m > p:
        m -= m % p
    rows = []
    for row in to_torch_csv(build_schedule(name, p, m)).splitlines():
        cells, out, i = row.split(","), [], 0
        while i < len(cells):
            pair = cells[i : i + 2]
            if len(pair) == 2 and all(_PAIRABLE.match(c) for c in pair) and rng.random() < 0.3:
                out.append(f"({pair[0]};{pair[1]})OVERLAP_F_B")
                i += 2
            else:
                out.append(cells[i])
                i += 1
        rows.append(",".join(out))
    path = directory / f"paired-{rng.randrange(10**9)}.csv"
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _limits(argv: list[str], p: int) -> list[float] | None:
    if "--mem-limit" not in argv:
        return None
    values = [float(x) for x in argv[argv.index("--mem-limit") + 1].split(",")]
    return values * p if len(values) == 1 else values


def test_every_configuration_is_refused_in_one_line_or_valid_and_within_budget(capsys, tmp_path):
    rng = random.Random(SEED)
    accepted = refused = 0
    for case in range(CASES):
        argv = random_configuration(rng, tmp_path)
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
def test_the_fuzz_configurations_are_reproducible(seed, tmp_path):
    first, second = (random_configuration(random.Random(seed), tmp_path) for _ in range(2))
    assert first == second
