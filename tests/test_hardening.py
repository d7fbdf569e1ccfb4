"""Issue 16's regressions: bad input gets one line on stderr, exit status 2, and nothing written;
passes after a budgeted generator keep its budget."""

import json

import pytest

from pipeloom.cli import main

SVPP = ["simulate", "svpp", "-p", "11", "-m", "8", "-v", "4", "--slices", "4", "--mem-limit", "12.681"]
SVPP_COSTS = ["--costs", "F=1.075,B=4.974,W=4.649,comm=1.062,M_B=2.689,M_W=1.077,attention_fraction=0.346"]
BUDGETS = "18.145,34.122,34.1,14.224,31.566,32.024,4.002,4.515,26.031,10.13,13.33"
ZB_COSTS = "F=0.161,B=0.397,W=3.393,comm=1.355,R=2.631,M_B=1.559,M_W=1.393,M_ckpt=0.61"


@pytest.mark.parametrize(
    "argv, message",
    [
        ([*SVPP, "--split", "deferred", *SVPP_COSTS], "device 0 peaks at 13.954 of activation memory, 1.273 over"),
        ([*SVPP, "--split", "fill", *SVPP_COSTS], "over its limit 12.681"),
        (["simulate", "1f1b", "-p", "4", "-m", "100000000"], "about 2,400,000,000 ops"),
        (["simulate", "1f1b", "-p", "4", "-m", "4", "--costs", "F=1e308,B=1e308", "--json"], "the costs overflow"),
        (["compare", "1f1b", "gpipe", "-p", "4", "-m", "4", "--costs", "F=1e308,B=1e308"], "the costs overflow"),
        (["simulate", "zb-auto", "-p", "4", "-m", "8", "--mem-limit", "40GiB", "--costs", "F=1,B=1"], "unit-less"),
        (["simulate", "1f1b", "-p", "4", "-m", "4", "--costs", "F=0,B=0"], "no work"),
    ],
)
def test_bad_input_is_one_line_exit_2_and_writes_nothing(capsys, tmp_path, argv, message):
    export = tmp_path / "out.json"
    extra = ["--export", str(export)] if argv[0] == "simulate" else []
    code = main([*argv, *extra])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and not export.exists()
    assert len(err.strip().splitlines()) == 1 and message in err


def test_weight_parts_keep_each_devices_budget(capsys):
    argv = ["simulate", "zb-auto", "-p", "11", "-m", "18", "--weight-parts", "1", "--mem-limit", BUDGETS]
    assert main([*argv, "--costs", ZB_COSTS, "--json"]) == 0
    peaks = json.loads(capsys.readouterr().out)["peak_activation_memory"]
    assert all(peak <= limit + 1e-9 for peak, limit in zip(peaks, map(float, BUDGETS.split(","))))


def test_recomputing_the_deepest_tpipe_chunk_runs(capsys):
    assert main(["simulate", "tpipe", "-p", "3", "-m", "2", "-v", "2", "--recompute", "1", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["makespan"] > 0
