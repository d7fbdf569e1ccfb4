"""The profile's probes taking turns with other runs (`probe_rounds.measure_probes`): where the
hook falls, and that `min_rounds` keeps settled probes going."""

from types import SimpleNamespace

from pipeloom.profile import probe_rounds


def _measure(monkeypatch, min_rounds: int, max_rounds: int) -> list[str]:
    events: list[str] = []

    def run_local(spec, probe=None):
        events.append(spec.name)
        return spec

    monkeypatch.setattr("pipeloom.runtime.local.run_local", run_local)
    monkeypatch.setattr("pipeloom.runtime.probe.probe_spec", lambda spec: None)
    monkeypatch.setattr(probe_rounds, "samples", lambda results: {"F@0": [1.0, 1.0]})  # settles at once
    monkeypatch.setattr(probe_rounds, "steady_probe", lambda key, schedule, rounds, series, variation: len(rounds))
    specs = {name: SimpleNamespace(name=name, schedule=None) for name in "ab"}
    measured = probe_rounds.measure_probes(
        specs, max_rounds, None, lambda: None, [], lambda: events.append("|"), min_rounds=min_rounds
    )
    assert all(count == len(events) // 3 for count in measured.values())
    return events


def test_the_hook_runs_after_every_round_of_the_probes(monkeypatch):
    assert _measure(monkeypatch, min_rounds=1, max_rounds=6) == ["a", "b", "|", "a", "b", "|"]  # settled on round 2


def test_settled_probes_go_on_for_min_rounds_but_never_past_max_rounds(monkeypatch):
    assert _measure(monkeypatch, min_rounds=4, max_rounds=6) == ["a", "b", "|"] * 4
    assert _measure(monkeypatch, min_rounds=9, max_rounds=3) == ["a", "b", "|"] * 3
