"""Overlapped F&B pairs under the passes and the memory model: the two ops run at once, in either
order in the file, so nothing goes between them and their memory is counted together."""

import pytest

from pipeloom import Costs, build_schedule, simulate, validate
from pipeloom.cli import main
from pipeloom.ir.torch_csv import from_torch_csv
from pipeloom.passes import split_backward
from pipeloom.passes.weight_parts import weight_parts

BACKWARD_FIRST = "0F0,(0B0;0F1)OVERLAP_F_B,0B1\n"


def heads_and_partners(schedule):
    """(head, partner) texts of every pair, device by device."""
    return [
        (ops[i].text, ops[i + 1].text) for ops in schedule.devices for i in range(len(ops) - 1) if ops[i].overlap_next
    ]


def test_a_backward_first_pair_holds_its_forward_while_its_backward_runs():
    """(B0;F1) runs F1 beside B0: F1's activations arrive while B0's are still held, 2 M_B at
    once — a budget of 1 M_B was once passed on the order written (B frees, then F holds)."""
    schedule = from_torch_csv(BACKWARD_FIRST)
    assert max(simulate(schedule, Costs(F=1, B=2)).peak_activation_memory) == 2
    forward_first = from_torch_csv("0F0,(0F1;0B0)OVERLAP_F_B,0B1\n")
    assert max(simulate(forward_first, Costs(F=1, B=2)).peak_activation_memory) == 2


def test_the_cli_refuses_a_budget_a_backward_first_pair_breaks(tmp_path, capsys):
    (tmp_path / "bf.csv").write_text(BACKWARD_FIRST)
    argv = ["simulate", "--schedule-file", str(tmp_path / "bf.csv"), "--costs", "F=1,B=2"]
    assert main(argv + ["--passes", "relax-checkpoint", "--mem-limit", "1"]) == 2
    err = capsys.readouterr().err
    assert "peaks at 2 of activation memory, 1 over its limit 1" in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("placement", ["after", "deferred", "fill"])
def test_splitting_keeps_a_backward_first_pair_and_puts_no_w_inside(placement):
    split = split_backward(from_torch_csv(BACKWARD_FIRST), placement, costs=Costs(F=1, B=2, W=1))
    validate(split)
    assert heads_and_partners(split) == [("0B0&", "0F1")]  # the text marks a head with &


def test_w_parts_never_go_between_a_pairs_two_ops():
    """DualPipeV with all-to-alls and 3 W parts once put a part between F2 and its paired B."""
    costs = Costs(F=1, B=2, W=3, a2a_F=0.3, a2a_B=0.3)
    schedule = build_schedule("dualpipev", 2, 3, costs=costs)
    for limit in (None, 4.0):
        parted = weight_parts(schedule, costs, parts=3, mem_limit=limit)
        validate(parted)
        assert len(heads_and_partners(parted)) == len(heads_and_partners(schedule)) > 0
