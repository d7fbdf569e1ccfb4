"""The profile's probes taking turns with other runs (`probe_rounds.run_by_turns`): where the
hook falls, and that `min_rounds` keeps settled probes going."""

from types import SimpleNamespace

import pytest

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
    turns = probe_rounds.Turns(max_rounds, min_rounds, between_rounds=lambda layout: events.append("|"))
    measured = probe_rounds.measure_probes(specs, turns, [])
    assert all(count == len(events) // 3 for count in measured.values())
    return events


def test_the_hook_runs_after_every_round_of_the_probes(monkeypatch):
    assert _measure(monkeypatch, min_rounds=1, max_rounds=6) == ["a", "b", "|", "a", "b", "|"]  # settled on round 2


def test_settled_probes_go_on_for_min_rounds_but_never_past_max_rounds(monkeypatch):
    assert _measure(monkeypatch, min_rounds=4, max_rounds=6) == ["a", "b", "|"] * 4
    assert _measure(monkeypatch, min_rounds=9, max_rounds=3) == ["a", "b", "|"] * 3


def test_tensor_parallel_probes_tell_the_hook_their_layout_and_keep_their_own_speeds(monkeypatch):
    """What takes turns with a layout's probes is told which layout ran (a plan is measured
    beside the probes that price it), and each layout's op variation is its own."""
    from pipeloom.profile import tp_probes
    from pipeloom.profile.probe_rounds import Turns
    from pipeloom.profile_format import Layout

    turns: list[Layout] = []

    def measure_probes(specs, rounds, op_variation):
        assert rounds.busy is None  # their ops wait inside collectives: no round is judged busy
        rounds.between_rounds(rounds.layout)
        op_variation.extend([1.0 + k / 100 for k in range(40)] if specs[1, 1] else [1.0] * 40)
        return {
            key: SimpleNamespace(
                busy=[[100.0, 110.0, 120.0] * 4], values={"F@0": None}, median=lambda _, n=key[1]: 2.0 * n
            )
            for key in specs
        }

    monkeypatch.setattr(tp_probes, "measure_probes", measure_probes)
    probed = SimpleNamespace(
        workload_for=lambda layers, mbs: None, spec=lambda *a, sequence_parallel, **kw: sequence_parallel
    )
    layouts = tp_probes.tensor_parallel_fits(
        [(2, False), (2, True)], probed, [1], [1, 2], Turns(3, between_rounds=turns.append)
    )
    assert turns == [Layout(2, False), Layout(2, True)]
    tp2, tp2sp = layouts[Layout(2)], layouts[Layout(2, True)]
    assert tp2.fits[1]["F"].per_layer == 2.0 and len(layouts) == 2
    assert tp2.speed.op[-1] == 1.0 and tp2sp.speed.op[-1] == pytest.approx(1.39)
    assert tp2.speed.step[0] == pytest.approx(100 / 110)
