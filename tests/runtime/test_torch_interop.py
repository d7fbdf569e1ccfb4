"""A pipeloom plan exported as torch.distributed.pipelining's CSV runs on torch's own runtime with
the gradients of single-process training: one stage a rank, and two a rank in the V placement
(each rank building the stages `stage_ranks` gives it), overlapped pairs included."""

import json
import multiprocessing
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.distributed import pipelining  # noqa: E402
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: E402

from pipeloom import Costs, build_schedule  # noqa: E402
from pipeloom.errors import ConfigError  # noqa: E402
from pipeloom.ir.torch_csv import check_placement, from_torch_csv, placement_of, stage_ranks, to_torch_csv  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.models.workload import llama_workload  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=2, ffn=64, seq_len=8, microbatch_size=2)
P, M = 2, 4


def _rank(rank: int, directory: str, num_stages: int, placement: str, layer_counts) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=P)
    work = llama_workload(CONFIG, seed=0, layer_counts=layer_counts)
    modules = work.build(num_stages)
    mine = [s for s, owner in enumerate(stage_ranks(P, num_stages, placement)) if owner == rank]
    stages = [pipelining.PipelineStage(modules[s], s, num_stages, torch.device("cpu")) for s in mine]
    schedule = _PipelineScheduleRuntime(stages, M, loss_fn=work.loss)
    schedule._load_csv(f"{directory}/plan.csv")
    tokens, targets = work.batch(M * CONFIG.microbatch_size, 0)
    losses: list = []
    inputs = (tokens,) if 0 in mine else ()
    if num_stages - 1 in mine:
        schedule.step(*inputs, target=targets, losses=losses)
    else:
        schedule.step(*inputs)
    grads = {f"{s}.{name}": p.grad.tolist() for s in mine for name, p in modules[s].named_parameters()}
    Path(directory, f"rank{rank}.json").write_text(json.dumps({"grads": grads, "losses": [float(x) for x in losses]}))
    dist.destroy_process_group()


def single_process_gradients(num_stages: int, layer_counts):
    """The same model on the same data in one process: mean of the micro-batch losses."""
    work = llama_workload(CONFIG, seed=0, layer_counts=layer_counts)
    stages = work.build(num_stages)
    tokens, targets = work.batch(M * CONFIG.microbatch_size, 0)
    b = CONFIG.microbatch_size
    losses = []
    for j in range(M):
        x = tokens[j * b : (j + 1) * b]
        for stage in stages:
            x = stage(x)
        losses.append(work.loss(x, targets[j * b : (j + 1) * b]))
    (sum(losses) / M).backward()
    return [{n: p.grad for n, p in stage.named_parameters()} for stage in stages], [float(x.detach()) for x in losses]


UNEVEN = Costs(F=(1.0, 3.0), B=(2.0, 6.0), W=(0.2, 0.6), comm=0.5)
"""A first stage of one layer and a second of three: zb-auto plans for the times they give (an
order of its own: every W of the second stage after its last backward)."""


@pytest.mark.parametrize(
    "name, options, layer_counts",
    [(name, {}, None) for name in ("1f1b", "zb-h1", "zb-v", "v-half", "dualpipev")]
    + [("zb-auto", {"costs": UNEVEN}, (1, 3))],
    ids=["1f1b", "zb-h1", "zb-v", "v-half", "dualpipev", "zb-auto-uneven"],
)
def test_exported_plan_runs_on_torch_with_reference_gradients(name, options, layer_counts):
    schedule = build_schedule(name, P, M, **options)
    csv_text = to_torch_csv(schedule)
    placement = placement_of(schedule)
    assert placement == ("v" if schedule.num_stages > P else "loop")
    elsewhere = "loop" if placement == "v" else "v"
    if schedule.num_stages > P:  # one stage a rank sits alike in both
        with pytest.raises(ConfigError, match=f"but the {elsewhere} placement puts it on rank"):
            check_placement(from_torch_csv(csv_text), elsewhere)  # what torch would accept, then fail on
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "plan.csv").write_text(csv_text)
        args = (directory, schedule.num_stages, placement, layer_counts)
        processes = [context.Process(target=_rank, args=(r, *args)) for r in range(P)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert all(process.exitcode == 0 for process in processes)
        results = [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(P)]
    reference, losses = single_process_gradients(schedule.num_stages, layer_counts)
    last = stage_ranks(P, schedule.num_stages, placement)[-1]
    assert results[last]["losses"] == pytest.approx(losses, rel=1e-5)
    compared = 0
    for result in results:
        for key, grad in result["grads"].items():
            stage, parameter = key.split(".", 1)
            torch.testing.assert_close(torch.tensor(grad), reference[int(stage)][parameter], rtol=1e-5, atol=1e-6)
            compared += 1
    assert compared == sum(len(r) for r in reference)  # every stage's every weight, on the rank that built it
