"""A tuned plan in torch.distributed.pipelining's words (`export-plan --for torch`), and the
placement check anyone can run on such a CSV (`validate --torch-csv`): a CSV whose stages do
not sit where the named placement builds them is refused in one line, exit 2, before any rank."""

import json

import pytest

from pipeloom import build_schedule
from pipeloom.cli import main
from pipeloom.ir.torch_csv import from_torch_csv, stage_ranks, to_torch_csv

TUNE = ["tune", "--model", "zb-1.5b", "--hardware", "rtx-4090", "--devices", "4", "--global-batch", "8"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def tuned(capsys, tmp_path, scheme: str):
    plan = tmp_path / f"{scheme}.json"
    code, _, err = run(capsys, *TUNE, "--schemes", scheme, "--max-mbs", "1", "--pp", "4", "--output", plan, "--force")
    assert code == 0, err
    return plan


@pytest.mark.parametrize("scheme, placement", [("zb-v", "v"), ("interleaved", "loop")])
def test_a_plan_exports_as_the_csv_of_its_schedule_with_its_placement_and_layers(capsys, tmp_path, scheme, placement):
    plan = tuned(capsys, tmp_path, scheme)
    code, out, err = run(capsys, "export-plan", plan, "--for", "torch", "--output", tmp_path / "torch")
    assert code == 0, err
    written = (tmp_path / "torch" / "schedule.csv").read_text()
    data = json.loads(plan.read_text())
    schedule = from_torch_csv(written)
    assert written == to_torch_csv(schedule) and schedule.num_stages == len(data["partition"])
    assert f"the {placement} placement" in out.splitlines()[0]
    ranks = stage_ranks(schedule.num_devices, schedule.num_stages, placement)
    for stage, layers in enumerate(data["partition"]):
        assert f"  stage {stage} on rank {ranks[stage]}: {layers} layer" in out
    assert f"n_microbatches={schedule.num_microbatches}" in out
    code, out, _ = run(capsys, "validate", "--torch-csv", tmp_path / "torch" / "schedule.csv", "--placement", placement)
    assert code == 0 and f"valid on the {placement} placement" in out
    code, _, err = run(capsys, "export-plan", plan, "--for", "torch", "--output", tmp_path / "torch")
    assert code == 2 and "exists; choose another --output or add --force" in err  # nothing replaced silently


def test_a_csv_on_the_wrong_placement_is_refused_in_one_line(capsys, tmp_path):
    csv = tmp_path / "zbv.csv"
    csv.write_text(to_torch_csv(build_schedule("zb-v", 4, 8)))
    code, out, err = run(capsys, "validate", "--torch-csv", csv, "--placement", "loop")
    assert code == 2 and not out and len(err.strip().splitlines()) == 1
    assert "runs stage 4 on rank 3, but the loop placement puts it on rank 0; it fits the v placement" in err
    code, out, _ = run(capsys, "validate", "--torch-csv", csv)  # no placement named: the one it needs
    assert code == 0 and "valid on the v placement: 4 ranks, 8 stages, 8 micro-batches" in out
    for argv, message in [
        (["validate"], "give a schedule FILE or --torch-csv FILE"),
        (["validate", "--placement", "v", csv], "--placement goes with --torch-csv"),
        (["validate", "--torch-csv", tmp_path / "missing.csv"], "cannot read torch CSV"),
    ]:
        code, _, err = run(capsys, *argv)
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1


def test_a_plan_torch_cannot_express_is_refused_naming_what_to_export(capsys, tmp_path):
    plan = tuned(capsys, tmp_path, "chimera")
    code, out, err = run(capsys, "export-plan", plan, "--for", "torch", "--output", tmp_path / "torch")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "two copies of the model" in err and "export 'interleaved' instead" in err
    assert not (tmp_path / "torch").exists()
