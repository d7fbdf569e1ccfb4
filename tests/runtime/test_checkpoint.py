"""Checkpoint and resume (torch.distributed.checkpoint): bit-identical continuation, torn ones refused."""

import shutil
from dataclasses import replace

import pytest

pytest.importorskip("torch")

from pipeloom import ConfigError, build_schedule  # noqa: E402
from pipeloom.errors import RuntimeFault  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.local import run_local  # noqa: E402
from pipeloom.runtime.training import TrainSpec, check_spec  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(layers=4, hidden=32, heads=2, ffn=64, vocab=64, seq_len=16)


def test_resume_continues_bit_identically(tmp_path):
    """Every step saved, and a resume from the last or from an earlier one continues the run that
    never saved, bit for bit (a split backward, replicas)."""
    schedule, dp = build_schedule("zb-h1", 2, 4), 2
    whole = run_in_process(TrainSpec(schedule, config=CONFIG, steps=4, dp=dp))  # the forked ranks' bits
    first = run_local(TrainSpec(schedule, config=CONFIG, steps=2, dp=dp, save_every=1, save_dir=str(tmp_path)))
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-1", "step-2"]
    resumed = run_local(TrainSpec(schedule, config=CONFIG, steps=4, dp=dp, resume_dir=str(tmp_path)))
    assert first[0].losses + resumed[0].losses == whole[0].losses  # exactly, not approximately
    for rank, result in enumerate(resumed):
        for stage, parameters in result.parameters.items():
            for key, value in parameters.items():
                assert (value == whole[rank].parameters[stage][key]).all()
    from_one = run_local(TrainSpec(schedule, config=CONFIG, steps=4, dp=dp, resume_dir=str(tmp_path / "step-1")))
    assert from_one[0].losses == whole[0].losses[1:]


def test_torn_missing_and_mismatched_checkpoints_are_refused(tmp_path):
    schedule = build_schedule("1f1b", 2, 4)
    run_local(TrainSpec(schedule, config=CONFIG, steps=2, save_every=2, save_dir=str(tmp_path)))

    def refused(message, steps=4):
        spec = TrainSpec(schedule, config=CONFIG, steps=steps, resume_dir=str(tmp_path))
        with pytest.raises(ConfigError, match=message):
            check_spec(spec)

    refused("already 2 steps in", steps=2)
    shutil.copytree(tmp_path / "step-2", tmp_path / "step-3")  # a newer checkpoint, torn mid-write
    (tmp_path / "step-3" / "COMPLETE").unlink()
    refused("step-3' is torn")
    shutil.rmtree(tmp_path / "step-3")
    (tmp_path / "step-4.partial").mkdir()  # an unfinished write is not a checkpoint at all
    check_spec(TrainSpec(schedule, config=CONFIG, steps=4, resume_dir=str(tmp_path)))
    other_layout = TrainSpec(build_schedule("zb-h1", 2, 4), config=CONFIG, steps=4, resume_dir=str(tmp_path))
    check_spec(other_layout)  # weights keyed by their names in the model: any schedule resumes
    marker = tmp_path / "step-2" / "COMPLETE"
    marker.write_text(marker.read_text().replace('"layout_free": true', '"layout_free": false'))
    with pytest.raises(ConfigError, match="running '1f1b', not 2 ranks running 'zb-h1', and its weights are keyed"):
        check_spec(other_layout)
    for other, trained_on in [
        ({"dtype": "bf16"}, "fp32 compute, not bf16"),
        ({"seed": 1}, r"synthetic tokens \(ids below 64, seed 0\), not synthetic tokens \(ids below 64, seed 1\)"),
    ]:  # other data or compute type: refused unless told, then resumed
        with pytest.raises(ConfigError, match=f"trained on {trained_on}: give the same --data/--dtype"):
            check_spec(TrainSpec(schedule, config=CONFIG, steps=4, resume_dir=str(tmp_path), **other))
        check_spec(
            TrainSpec(schedule, config=CONFIG, steps=4, resume_dir=str(tmp_path), allow_input_change=True, **other)
        )
    bigger = TrainSpec(schedule, config=replace(CONFIG, layers=6), steps=4, resume_dir=str(tmp_path))
    with pytest.raises(RuntimeFault, match="rank 1 failed: checkpoint .*step-2' holds another model: it holds no lay"):
        run_local(bigger)  # rank 1's own error, not rank 0's echo of it ("connection closed by peer")
    with pytest.raises(ConfigError, match="no checkpoint in"):
        check_spec(TrainSpec(schedule, config=CONFIG, steps=4, resume_dir=str(tmp_path / "empty")))
    with pytest.raises(ConfigError, match="go together|need both"):
        check_spec(TrainSpec(schedule, config=CONFIG, steps=4, save_every=2))


def test_the_last_step_is_saved_old_checkpoints_pruned_and_each_save_said_once(tmp_path, capfd):
    """--save-every 2 --steps 3 once never saved step 3, and nothing pruned old checkpoints or
    said anything on a save: now the last step is saved, --keep-last 1 leaves only it, and rank
    0 prints one line per save (and one on resume)."""
    schedule = build_schedule("1f1b", 2, 4)
    spec = TrainSpec(schedule, config=CONFIG, steps=3, save_every=2, keep_last=1, save_dir=str(tmp_path), report=True)
    run_local(spec)
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-3"]
    said = [line for line in capfd.readouterr().out.splitlines() if line.startswith("saved checkpoint")]
    assert said == [
        f"saved checkpoint {tmp_path / 'step-2'}",
        f"saved checkpoint {tmp_path / 'step-3'}, removed step-2 (--keep-last 1)",
    ]
    run_local(TrainSpec(schedule, config=CONFIG, steps=4, resume_dir=str(tmp_path), report=True))
    assert f"resumed from {tmp_path / 'step-3'}: 3 of 4 steps done" in capfd.readouterr().out
    with pytest.raises(ConfigError, match="--keep-last K"):
        check_spec(TrainSpec(schedule, config=CONFIG, steps=4, keep_last=2))
