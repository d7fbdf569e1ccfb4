"""How fast the machine runs now against while it was profiled: one of the profile's probes again.

A virtual machine's speed drifts over minutes, beyond the slow spells `speed.steady_steps`
leaves out: here the same 1F1B plan's steady step measured 207 ms in one run of
bench/fidelity.py and 182–190 ms in runs ten minutes later, its ops' wall time still their CPU
time (a neighbour on the host taking the memory bandwidth and the shared cache). A profile is
the machine as it ran while profiled, and so is every prediction made from it: a run's step set
against its prediction mixes the model's error with the machine's drift since the profile.

The speed check tells the two apart. It runs one of the profile's own probes again (the same
work: `probe_rounds.probe_train_spec`), and its ops' time per steady step over what the profile
measured for that probe (`PROBE_BUSY`) is how much slower (above 1) or faster the machine runs
now. The probe is the one profiled at the plans' micro-batch size and layers per stage, so its
ops are the plans' own: the ratio prices the drift of a plan's pipeline.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from itertools import compress

from pipeloom.errors import ConfigError
from pipeloom.profile.speed import steady_steps, step_busy, timed_steps

__all__ = ["PROBE_BUSY", "SpeedCheck", "probe_busy", "reference_probe", "speed_check"]

PROBE_BUSY = "probe_busy_ms"
"""The profile's key: per probe ("2x4": micro-batch size × layers per stage), each rank's median
time in ops per steady step (ms)."""


@dataclass(frozen=True)
class SpeedCheck:
    """One run of a profiled probe against the profile's own measurement of it."""

    probe: str
    profiled_ms: tuple[float, ...]
    """Per rank, its time in ops per step while profiled."""
    now_ms: tuple[float, ...]
    """Per rank, the same now (the median over the run's steady steps)."""

    @property
    def ratio(self) -> float:
        """The machine's time now over its time while profiled, for the same ops."""
        return sum(self.now_ms) / sum(self.profiled_ms)


def probe_busy(measured: dict) -> dict[str, list[float]]:
    """`PROBE_BUSY` from the profiler's probes ((micro-batch size, layers) → `Probe`)."""
    return {
        f"{mbs}x{layers}": [statistics.median(steps) for steps in probe.busy]
        for (mbs, layers), probe in measured.items()
    }


def reference_probe(profile: dict, mbs: int, layers: int) -> tuple[int, int]:
    """The profiled probe to check with for plans at micro-batch size `mbs` and `layers` layers a
    stage: that one where it was profiled, else the largest (the least fixed cost per op ms)."""
    probes = profile.get(PROBE_BUSY)
    if not probes:
        raise ConfigError("profile: it holds no probe times to check the machine's speed against; profile again")
    if f"{mbs}x{layers}" in probes:
        return mbs, layers
    largest, most = max((int(size), int(count)) for size, count in (key.split("x") for key in probes))
    return largest, most


def speed_check(
    profile: dict, model, mbs: int, layers: int, steps: int = 8, threads: int = 1, workload_for=None
) -> SpeedCheck:
    """Run the profile's probe nearest (`mbs`, `layers`) once, `steps` steps (the warm-up left
    out), built as the profile built it (`model`, `workload_for`: as given to `profile_model`)."""
    from pipeloom.profile.probe_rounds import probe_train_spec
    from pipeloom.runtime.local import run_local

    mbs, layers = reference_probe(profile, mbs, layers)
    dtype = str(profile.get("dtype", "fp32"))
    results = run_local(probe_train_spec(model, steps, threads, workload_for, dtype, mbs, layers))
    busy = [step_busy(timed_steps(result.records)) for result in results]
    kept = steady_steps(busy)
    now = tuple(statistics.median(compress(times, kept)) for times in busy)
    key = f"{mbs}x{layers}"
    return SpeedCheck(key, tuple(profile[PROBE_BUSY][key]), now)
