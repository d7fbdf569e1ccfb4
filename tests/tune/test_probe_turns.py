"""The profile's probes taking turns (`probe_rounds.run_by_turns`): a round of each at a time,
settled probes kept going for `min_rounds`, never past `max_rounds`."""

from types import SimpleNamespace

import pytest
import torch

from pipeloom.profile import probe_rounds
from pipeloom.runtime.spec import RankResult


def _measure(monkeypatch, min_rounds: int, max_rounds: int) -> list[str]:
    events: list[str] = []

    def run_local(spec, probe=None):
        events.append(spec.name)
        return [RankResult(0)]

    monkeypatch.setattr("pipeloom.runtime.local.run_local", run_local)
    monkeypatch.setattr("pipeloom.runtime.probe.probe_spec", lambda spec: None)
    monkeypatch.setattr(probe_rounds, "samples", lambda results: {"F@0": [1.0, 1.0]})  # settles at once
    monkeypatch.setattr(probe_rounds, "steady_probe", lambda schedule, rounds, series, variation: len(rounds))
    specs = {name: SimpleNamespace(name=name, schedule=None) for name in "ab"}
    measured = probe_rounds.measure_probes(specs, probe_rounds.Turns(max_rounds, min_rounds), [])
    assert all(count == len(events) // 2 for count in measured.values())
    return events


def test_the_probes_take_a_round_each_at_a_time(monkeypatch):
    assert _measure(monkeypatch, min_rounds=1, max_rounds=6) == ["a", "b", "a", "b"]  # settled on round 2


def test_the_rounds_kept_hold_no_weights(monkeypatch):
    """Every round's results are kept until the last: their weights and gradients, which no
    measurement reads, are not."""
    weights = {0: {"weight": torch.ones(4)}}
    monkeypatch.setattr(
        "pipeloom.runtime.local.run_local",
        lambda spec, probe=None: [RankResult(0, parameters=weights, gradients=weights, losses=[2.0])],
    )
    monkeypatch.setattr("pipeloom.runtime.probe.probe_spec", lambda spec: None)
    monkeypatch.setattr(probe_rounds, "samples", lambda results: {"F@0": [1.0]})
    rounds, _ = probe_rounds.run_by_turns({"a": None}, probe_rounds.Turns().fixed(2))
    assert [(r.parameters, r.gradients, r.losses) for results in rounds["a"] for r in results] == [({}, {}, [2.0])] * 2


def test_settled_probes_go_on_for_min_rounds_but_never_past_max_rounds(monkeypatch):
    assert _measure(monkeypatch, min_rounds=4, max_rounds=6) == ["a", "b"] * 4
    assert _measure(monkeypatch, min_rounds=9, max_rounds=3) == ["a", "b"] * 3


def test_tensor_parallel_probes_keep_their_own_speeds(monkeypatch):
    """Each layout's op variation is its own, its rounds are not judged busy, and a stage over
    tp ranks is fitted at the single stage's position from its first rank."""
    from pipeloom.profile import layouts
    from pipeloom.profile.probe_rounds import Turns
    from pipeloom.profile_format import Layout

    def measure_probes(specs, rounds, op_variation):
        assert rounds.busy is None  # their ops wait inside collectives: no round is judged busy
        op_variation.extend([1.0 + k / 100 for k in range(40)] if specs[1, 1] else [1.0] * 40)
        return {
            key: SimpleNamespace(
                busy=[[100.0, 110.0, 120.0] * 4],
                values=dict.fromkeys(("F@0", "F@1"), SimpleNamespace(relative_error=0.01)),
                median=lambda key, n=key[1]: 2.0 * n if key == "F@0" else 99.0,
            )
            for key in specs
        }

    monkeypatch.setattr(layouts, "measure_probes", measure_probes)
    probed = SimpleNamespace(spec=lambda *a, sequence_parallel, **kw: sequence_parallel)
    measured = {
        layout: layouts.measure_layout(layout, probed, [1], [1, 2], Turns(3, busy=SimpleNamespace()))[0]
        for layout in (Layout(2, False), Layout(2, True))
    }
    tp2, tp2sp = measured[Layout(2)], measured[Layout(2, True)]
    assert tp2.fits[1]["F"].per_layer == 2.0 and tp2.fits[1]["F"].single == 0.0 and tp2.fits[1]["F"].first is None
    assert tp2.speed.op[-1] == 1.0 and tp2sp.speed.op[-1] == pytest.approx(1.39)
    assert tp2.speed.step[0] == pytest.approx(100 / 110)


def test_an_op_s_exchanges_in_flight_are_sampled_apart_from_its_compute():
    """A step's all-to-alls in flight, shared evenly over its forwards (F and R) and its backwards:
    each op's sample is its compute, the exchanges their own samples. Neither a checkpointed F nor
    the step's first op is sampled."""
    ops = [("0F0", 0.0, 0.012), ("0F1", 0.012, 0.022), ("0F2c", 0.022, 0.030)]
    ops += [("0B0", 0.03, 0.05), ("0R2", 0.05, 0.06), ("0B1", 0.06, 0.08)]
    record = SimpleNamespace(ops=ops, entry_bytes={}, pending_w_bytes={}, a2a_ms=10.0, a2a_forward_ms=4.0)
    result = SimpleNamespace(records=[record] * 3, phase_seconds=[dict.fromkeys(probe_rounds.PHASES, 0.0)] * 3)
    taken = probe_rounds.samples([result])
    assert taken["a2a_F@0"] == [1.0] and taken["a2a_B@0"] == [3.0]  # 4 ms over 4 forwards, 6 over 2 backwards
    assert taken["F@0"] == pytest.approx([9.0]) and taken["R@0"] == pytest.approx([9.0])  # 0F1's compute alone
    assert taken["B@0"] == pytest.approx([17.0, 17.0])
