"""A tuned plan in torch.distributed.pipelining's words (`export-plan --for torch`), and the
placement check anyone can run on such a CSV (`validate --torch-csv`): a CSV whose stages do
not sit where the named placement builds them is refused in one line, exit 2, before any rank."""

import json
import random
import tomllib
from pathlib import Path

import pytest

from pipeloom import build_schedule
from pipeloom.cli import main
from pipeloom.ir.torch_csv import from_torch_csv, stage_ranks, to_torch_csv

# importing torchtitan and megatron-core warns of their own absent extras and deprecations
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

TUNE = ["tune", "--model", "zb-1.5b", "--hardware", "rtx-4090", "--devices", "4", "--global-batch", "8"]


def run(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Plans tuned once for the module, by scheme (each test exports into its own directory)."""
    return tmp_path_factory.mktemp("plans"), {}


def tuned(capsys, plans, scheme: str):
    directory, made = plans
    if scheme not in made:
        plan = directory / f"{scheme}.json"
        argv = [*TUNE, "--schemes", scheme, "--max-mbs", "1", "--pp", "4", "--jobs", "1", "--output", plan]
        code, _, err = run(capsys, *argv)
        assert code == 0, err
        made[scheme] = plan
    return made[scheme]


@pytest.mark.parametrize("scheme, placement", [("zb-v", "v"), ("interleaved", "loop")])
def test_a_plan_exports_as_the_csv_of_its_schedule_with_its_placement_and_layers(
    capsys, tmp_path, plans, scheme, placement
):
    plan = tuned(capsys, plans, scheme)
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


def test_a_plan_torch_cannot_express_is_refused_naming_what_to_export(capsys, tmp_path, plans):
    plan = tuned(capsys, plans, "chimera")
    code, out, err = run(capsys, "export-plan", plan, "--for", "torch", "--output", tmp_path / "torch")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "two copies of the model" in err and "export 'interleaved' instead" in err
    assert not (tmp_path / "torch").exists()


def test_a_sliced_plan_is_refused_naming_the_scheme_not_a_flag_that_keeps_its_w_parts(capsys, tmp_path, plans):
    """svpp's W parts are its own pass: `tune --no-memory-passes` (once advised) leaves them in."""
    plan = tuned(capsys, plans, "svpp")
    assert "wparts" in json.loads(plan.read_text())["passes"]
    code, out, err = run(capsys, "export-plan", plan, "--for", "torch", "--output", tmp_path / "torch")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "has slices" in err and "export 'interleaved' instead" in err and "--no-memory-passes" not in err


@pytest.mark.parametrize("scheme, placement", [("zb-v", "v"), ("interleaved", "loop"), ("1f1b", "loop")])
def test_the_torchtitan_fragment_makes_torchtitan_build_the_csv_s_stages(capsys, tmp_path, plans, scheme, placement):
    """torchtitan's own config classes take the fragment, and its own stage placement (chosen by
    the schedule's name) puts on every rank the stages the CSV runs there; its micro-batch count
    (local batch over micro-batch size) is the CSV's; the layers are the plan's partition."""
    plan = tuned(capsys, plans, scheme)
    code, out, err = run(capsys, "export-plan", plan, "--for", "torchtitan", "--output", tmp_path / "titan")
    assert code == 0, err
    fragment = tomllib.loads((tmp_path / "titan" / "torchtitan.toml").read_text())
    parallelism, training = fragment["parallelism"], fragment["training"]
    schedule = from_torch_csv(Path(parallelism["pipeline_parallel_schedule_csv"]).read_text())
    partition = json.loads(plan.read_text())["partition"]
    fqns = parallelism["module_fqns_per_model_part"]
    assert [sum(name.startswith("layers.") for name in part) for part in fqns] == partition
    assert [name for part in fqns for name in part if name.startswith("layers.")] == [
        f"layers.{i}" for i in range(sum(partition))
    ]
    assert fqns[0][0] == "tok_embeddings" and fqns[-1][-2:] == ["norm", "lm_head"]
    assert training["local_batch_size"] // parallelism["pipeline_parallel_microbatch_size"] == schedule.num_microbatches
    assert f"the {placement} placement" in out
    pytest.importorskip("torch")
    titan = pytest.importorskip("torchtitan.distributed.pipeline_parallel", reason="torchtitan is beside the venv")
    from torchtitan.config.configs import ParallelismConfig, TrainingConfig

    ParallelismConfig(**parallelism), TrainingConfig(**training)  # unknown or mistyped fields refused
    for rank in range(schedule.num_devices):
        built = titan._get_pp_rank_to_stage_indices_mapping(
            rank, parallelism["pipeline_parallel_degree"], parallelism["pipeline_parallel_schedule"], len(fqns)
        )
        assert sorted(built) == schedule.stages_on(rank)


def megatron_layout_class():
    pytest.importorskip("torch")
    layout = pytest.importorskip(
        "megatron.core.transformer.pipeline_parallel_layer_layout", reason="megatron-core is beside the venv"
    )
    return layout.PipelineParallelLayerLayout


def assert_megatron_builds(layout: str, pp: int, partition: list[int]) -> None:
    """megatron-core's own layout class takes the string, finds every layer once, and builds on
    pipeline rank k mod pp, virtual stage k div pp, the layers of the plan's stage k."""
    from megatron.core.transformer.enums import LayerType

    parsed = megatron_layout_class()(layout, pp)
    parsed.validate_layer_layout(sum(partition), None)
    assert parsed.virtual_pipeline_model_parallel_size * pp == len(partition)
    for stage, layers in enumerate(partition):
        assert parsed.layout[stage % pp][stage // pp].count(LayerType.decoder) == layers


@pytest.mark.parametrize("scheme", ["interleaved", "1f1b"])
def test_the_megatron_arguments_make_megatron_build_the_plan_s_stages(capsys, tmp_path, plans, scheme):
    plan = tuned(capsys, plans, scheme)
    code, out, err = run(capsys, "export-plan", plan, "--for", "megatron", "--output", tmp_path / "mlm")
    assert code == 0, err
    words = (tmp_path / "mlm" / "megatron-args.txt").read_text().splitlines()[-1].split()
    data = json.loads(plan.read_text())
    flags = {flag: value for flag, value in zip(words, words[1:]) if flag.startswith("--")}
    assert int(flags["--pipeline-model-parallel-size"]) == data["pp"]
    assert int(flags["--micro-batch-size"]) == data["micro_batch_size"]
    assert int(flags["--global-batch-size"]) == data["global_batch"]
    assert int(flags["--tensor-model-parallel-size"]) == data["tp"]
    layout = flags["--pipeline-model-parallel-layout"].strip("'")
    assert_megatron_builds(layout, data["pp"], data["partition"])


def test_uneven_partitions_are_layouts_megatron_reads():
    """The layout string of any partition, short runs spelled out and long ones as t*n."""
    from pipeloom.tune.partition import layout_string

    rng = random.Random(3)
    for _ in range(40):
        pp = rng.choice([1, 2, 4, 8])
        stages = pp * rng.choice([1, 2, 3])
        partition = [rng.randint(0, 20) for _ in range(stages)]
        partition[rng.randrange(stages)] += 1  # at least one layer
        assert_megatron_builds(layout_string(partition), pp, partition)


def test_a_plan_megatron_would_place_otherwise_is_refused(capsys, tmp_path, plans):
    plan = tuned(capsys, plans, "zb-v")
    code, _, err = run(capsys, "export-plan", plan, "--for", "megatron", "--output", tmp_path / "mlm")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "sits in the v placement; Megatron-LM's virtual stages sit in the loop placement" in err
    assert not (tmp_path / "mlm").exists()


def test_a_context_parallel_plan_exports_its_cp_to_both_engines(capsys, tmp_path):
    plan = tmp_path / "cp.json"
    argv = ["tune", "--model", "llama2-7b", "--hardware", "h100", "--devices", "16", "--global-batch", "16"]
    argv += ["--seq-len", "16384", "--tp", "4", "--cp", "2", "--pp", "2", "--schemes", "interleaved"]
    code, _, err = run(capsys, *argv, "--max-mbs", "1", "--jobs", "1", "--output", plan)
    assert code == 0, err
    assert json.loads(plan.read_text())["cp"] == 2
    code, _, err = run(capsys, "export-plan", plan, "--for", "torchtitan", "--output", tmp_path / "titan")
    assert code == 0, err
    fragment = tomllib.loads((tmp_path / "titan" / "torchtitan.toml").read_text())
    assert fragment["parallelism"]["context_parallel_degree"] == 2
    assert fragment["parallelism"]["tensor_parallel_degree"] == 4
    code, _, err = run(capsys, "export-plan", plan, "--for", "megatron", "--output", tmp_path / "mlm")
    assert code == 0, err
    words = (tmp_path / "mlm" / "megatron-args.txt").read_text().splitlines()[-1].split()
    flags = {flag: value for flag, value in zip(words, words[1:]) if flag.startswith("--")}
    assert flags["--context-parallel-size"] == "2" and flags["--tensor-model-parallel-size"] == "4"
