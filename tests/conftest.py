"""Shared fixtures: random generator arguments inside each generator's domain, for the fuzz tests;
`tests/helpers` importable as `helpers`."""

import gc
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # the shared helpers: `from helpers.runtime import ...`
for _beside in ("vision-for-tests", "torchtitan-for-tests", "megatron-for-tests"):  # beside the venv (Makefile)
    if (Path(sys.prefix) / _beside).is_dir():
        sys.path.append(str(Path(sys.prefix) / _beside))

# the suite's own parallel workers keep the machine busy: profiles measured inside it keep busy rounds
# (and say so) instead of refusing the machine, which is what a user's profile does
os.environ["PIPELOOM_ALLOW_BUSY"] = "1"
# one intra-op thread a worker: `make test` runs a worker per core, and OpenMP's idle threads spin
# on the core the other worker needs (a tenth of the suite's CPU time). A run's ranks set their own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

from pipeloom import build_schedule  # noqa: E402
from pipeloom.schedules import get_generator  # noqa: E402


def random_schedule(rng: random.Random, names: list[str], max_devices: int, **costs_for_generators):
    """A random valid (name, schedule): sizes bent into the generator's domain (interleaved needs
    m a multiple of p beyond p, Chimera even p and m); generators that take the keyword
    arguments `costs_for_generators` get them."""
    name = rng.choice(names)
    p = rng.randint(1, max_devices)
    m = rng.randint(1, 3 * p)
    options = get_generator(name).options
    kwargs = {key: value for key, value in costs_for_generators.items() if key in options}
    if name == "interleaved":
        kwargs["num_chunks"] = rng.randint(1, 3)
        m = m - m % p if m > p else m
    if name == "chimera":
        p, m = p + p % 2, m + m % 2
    return name, build_schedule(name, p, m, **kwargs)


@pytest.fixture
def pick_schedule():
    return random_schedule


def pytest_collection_modifyitems(items):
    """The long tests first (the README walk-through and the compiled stages' cold compile, then
    the other `slow` ones): xdist's workers then fill in behind them with short ones, instead of
    one worker starting a 30 s test near the end while the other has nothing left to do."""
    longest = ("tests/test_readme.py", "tests/runtime/test_compiled.py::test_compiled_stages")

    def rank(item) -> int:
        if item.nodeid.startswith(longest) and item.get_closest_marker("slow"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2

    items.sort(key=rank)


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, every test module) stays out of the
    worker's garbage collections: each full collection would walk it all again."""
    gc.freeze()
