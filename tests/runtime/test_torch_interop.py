"""A pipeloom plan exported as torch.distributed.pipelining's CSV runs on torch's own runtime with
the gradients of single-process training."""

import json
import multiprocessing
import tempfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from torch.distributed import pipelining  # noqa: E402
from torch.distributed.pipelining.schedules import _PipelineScheduleRuntime  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.ir.torch_csv import to_torch_csv  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.models.workload import llama_workload  # noqa: E402

pytestmark = pytest.mark.slow

CONFIG = LlamaConfig(vocab=64, hidden=32, layers=4, heads=2, ffn=64, seq_len=8, microbatch_size=2)
P, M = 2, 4


def _rank(rank: int, directory: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{directory}/store", rank=rank, world_size=P)
    work = llama_workload(CONFIG, seed=0)
    module = work.build(P)[rank]
    stage = pipelining.PipelineStage(module, rank, P, torch.device("cpu"))
    schedule = _PipelineScheduleRuntime([stage], M, loss_fn=work.loss)
    schedule._load_csv(f"{directory}/plan.csv")
    tokens, targets = work.batch(M * CONFIG.microbatch_size, 0)
    losses: list = []
    if rank == 0:
        schedule.step(tokens)
    else:
        schedule.step(target=targets, losses=losses)
    grads = {name: p.grad.tolist() for name, p in module.named_parameters()}
    Path(directory, f"rank{rank}.json").write_text(json.dumps({"grads": grads, "losses": [float(x) for x in losses]}))
    dist.destroy_process_group()


def single_process_gradients():
    """The same model on the same data in one process: mean of the micro-batch losses."""
    work = llama_workload(CONFIG, seed=0)
    stages = work.build(P)
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


@pytest.mark.parametrize("name", ["1f1b", "zb-h1"])
def test_exported_plan_runs_on_torch_with_reference_gradients(name):
    csv_text = to_torch_csv(build_schedule(name, P, M))
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory() as directory:
        Path(directory, "plan.csv").write_text(csv_text)
        processes = [context.Process(target=_rank, args=(r, directory)) for r in range(P)]
        for process in processes:
            process.start()
        for process in processes:
            process.join(120)
        assert all(process.exitcode == 0 for process in processes)
        results = [json.loads(Path(directory, f"rank{r}.json").read_text()) for r in range(P)]
    reference, losses = single_process_gradients()
    assert results[1]["losses"] == pytest.approx(losses, rel=1e-5)
    for rank in range(P):
        for parameter, grad in results[rank]["grads"].items():
            torch.testing.assert_close(torch.tensor(grad), reference[rank][parameter], rtol=1e-4, atol=1e-6)
