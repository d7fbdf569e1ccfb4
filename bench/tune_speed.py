"""How long `tune` takes on paper-scale searches, from presets alone.

1. Mario §6.7: GPT3-13B on 64 A100-40G, global batch 128, 1F1B, Chimera and interleaved, pp ∈ {4,
   8, 16, 32, 64}, micro-batch size ∈ {1, ..., 32}, Mario on and off. Goal ≤ 10 s (Mario reports
   210 s). Then the same model and cluster with `tune`'s default space (every scheme, tp and cp), as
   `pipeloom tune --model gpt3-13b --devices 64 --memory 40GiB --global-batch 128 --hardware
   a100-40g` runs it. Goal ≤ 10 s; and that command itself, from a shell (start-up, plan.json and
   the timeline's PNG included).
2. 1024 devices: GPT3-175B on 1024 A100-80G (8 a node), global batch 1536, every scheme, pp ∈
   {2, ..., 128}, micro-batch size ∈ {1, ..., 16}, and tp and cp searched as `tune` does by
   default (`topology.model_splits`). Goal ≥ 240 configurations in ≤ 30 s (Mario: 1060 ms per
   iteration), and tp inside a node.
3. Long sequences: LLaMA-2 70B on 64 H100, global batch 512, sequences of 32,768 tokens, tp and
   cp searched; then the same search with tp, and then cp, fixed to each of its values in turn:
   the free search must be within 10 % of the best of those — it does not miss its own best.
   Priced with sequence parallelism, as Megatron-LM runs tp. Beside it, the layouts of NVIDIA
   NeMo's published Megatron-core recipes for Llama 3 70B at long context (`llama3_70b_16k`:
   tp 2, pp 4 with 5 virtual stages, cp 2; `llama3_70b_64k`: tp 8, pp 4 × 5, cp 8 on 256 GPUs —
   here its cp halved to 2 to fit 64), priced by the same model. `--quick` leaves this case out.
Prints the configurations, how many were simulated, pruned and ruled out, the wall time and the
best plan, on every core (`--jobs N` for fewer; the plans are the same for any N).
Usage: python bench/tune_speed.py [--jobs N] [--quick]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

from pipeloom.errors import ConfigError, PipeloomError
from pipeloom.ir.torch_csv import placement_of
from pipeloom.tune.cost_model import AnalyticCostModel
from pipeloom.tune.partition import layout_string
from pipeloom.tune.pool import default_jobs
from pipeloom.tune.presets import load_hardware, load_model
from pipeloom.tune.search import evaluate, tune
from pipeloom.tune.space import Candidate, candidates
from pipeloom.tune.topology import Split, model_splits

GIB = 2**30


def run(
    title: str,
    model: str,
    hardware: str,
    devices: int,
    batch: int,
    goal: float,
    jobs: int,
    splits: list[Split] | None = None,
    **space,
):
    """`tune` on `splits` (default: tp = cp = 1), timed; the result."""
    cost_model = AnalyticCostModel(load_model(model), load_hardware(hardware))
    memory = cost_model.hardware.memory
    splits = splits or [Split()]
    points = len(list(candidates(devices, batch, splits=splits, num_layers=cost_model.model.layers, **space)))
    began = time.perf_counter()
    result = tune(cost_model, devices, memory, batch, splits=splits, jobs=jobs, **space)
    seconds = time.perf_counter() - began
    best = result.best
    print(f"\n{title}")
    print(
        f"  {points} configurations (each also with Mario / T-Recomp where memory is short): simulated {result.evaluated}, "
        f"pruned {result.pruned}, ruled out {len(result.rejected)}"
    )
    print(
        f"  wall time {seconds:.2f} s on {jobs} process(es) (goal ≤ {goal:g} s: {'met' if seconds <= goal else 'missed'})"
    )
    print(
        f"  best: {best.candidate.label}, step {best.step_time:.0f} ms, {result.throughput(best):.1f} samples/s, "
        f"peak {max(best.peak_memory) / GIB:.1f} GiB, layers per stage {best.partition[:4]}..."
    )
    print(f"  Megatron-LM layout of its partition: {megatron_check(best)}")
    print(f"  export-plan --for megatron: {megatron_export(best)}")
    return result


def long_sequences(jobs: int) -> None:
    """Case 3: the free search against tp, then cp, fixed to each value in turn, and a
    Megatron-style long-context layout beside it."""
    import dataclasses

    model = dataclasses.replace(load_model("llama2-70b"), seq_len=32768)
    hardware = load_hardware("h100")
    every = model_splits(model, 64, hardware.gpus_per_node)
    cost_model = AnalyticCostModel(model, hardware, sequence_parallel=True)
    began = time.perf_counter()
    free = tune(cost_model, 64, hardware.memory, 512, splits=every, jobs=jobs)
    print("\nLong sequences: LLaMA2-70B, 64 × H100, global batch 512, 32,768 tokens, tp and cp searched")
    print(f"  {len(every)} splits, wall time {time.perf_counter() - began:.1f} s")
    print(f"  best: {free.best.candidate.label}, step {free.best.step_time / 1e3:.1f} s")
    fixed = []
    for name in ("tp", "cp"):
        for value in sorted({getattr(split, name) for split in every}):
            chosen = [split for split in every if getattr(split, name) == value]
            try:
                best = tune(cost_model, 64, hardware.memory, 512, splits=chosen, jobs=jobs, keep=1).best
            except PipeloomError:
                print(f"  {name} = {value}: no plan fits")
                continue
            fixed.append(best)
            print(f"  {name} = {value}: {best.candidate.label}, step {best.step_time / 1e3:.1f} s")
    least = min(fixed, key=lambda e: e.step_time)
    gap = free.best.step_time / least.step_time - 1
    print(
        f"  free search against the best with one fixed: {gap:+.1%} (goal within 10 %: {'met' if gap <= 0.1 else 'missed'})"
    )
    recipes = {
        "NeMo llama3_70b_16k's layout: tp 2 × cp 2 × pp 4 (5 virtual), dp 4": Candidate(
            "interleaved", 4, 4, 1, 128, chunks=5, split=Split(tp=2, cp=2)
        ),
        "NeMo llama3_70b_64k's layout, cp 8 → 2: tp 8 × cp 2 × pp 4 (5 virtual), dp 1": Candidate(
            "interleaved", 4, 1, 1, 512, chunks=5, split=Split(tp=8, cp=2)
        ),
    }
    for what, candidate in recipes.items():
        priced = evaluate(candidate, cost_model, hardware.memory)
        verdict = (
            f"{priced.candidate.label}, step {priced.step_time / 1e3:.1f} s ({priced.step_time / free.best.step_time - 1:+.1%})"
            if priced.feasible
            else f"does not fit: {priced.reason}"
        )
        print(f"  {what}: {verdict}")


def megatron_export(best) -> str:
    """Whether `export-plan --for megatron` takes the plan: Megatron-LM runs its own 1F1B or
    interleaved 1F1B in the loop placement, so a plan in another placement is refused."""
    try:
        placement = placement_of(best.schedule)
    except ConfigError as error:
        return f"refused ({error.summary})"
    return "written" if placement == "loop" else f"refused (the {placement} placement; Megatron-LM's is loop)"


def megatron_check(best) -> str:
    """The best plan's layout string, read back by megatron-core's own layout class where it can
    be imported (the Makefile puts it beside the venv): every layer once, each stage's count."""
    layout, pp = layout_string(best.partition), best.candidate.pp
    megatron = Path(sys.prefix) / "megatron-for-tests"
    if megatron.is_dir() and str(megatron) not in sys.path:
        sys.path.append(str(megatron))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # its absent Transformer Engine and Apex
            from megatron.core.transformer.enums import LayerType
            from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout
    except ImportError:
        return f"{layout} (megatron-core not importable here: not checked)"
    parsed = PipelineParallelLayerLayout(layout, pp)
    parsed.validate_layer_layout(sum(best.partition), None)
    built = [parsed.layout[k % pp][k // pp].count(LayerType.decoder) for k in range(len(best.partition))]
    verdict = "its stages' layers as planned" if built == list(best.partition) else f"other layers: {built}"
    return f"{layout} — megatron-core reads pp {pp} × vpp {parsed.virtual_pipeline_model_parallel_size}, {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=default_jobs(), help="processes (default: every core)")
    parser.add_argument("--quick", action="store_true", help="leave out the long-sequence case (minutes)")
    args = parser.parse_args()
    jobs, quick = args.jobs, args.quick
    print(f"python {platform.python_version()} on {platform.machine()}, {default_jobs()} core(s)")
    run(
        "Mario §6.7: GPT3-13B, 64 × A100-40G, global batch 128",
        "gpt3-13b",
        "a100-40g",
        64,
        128,
        10,
        jobs,
        schemes=["1f1b", "chimera", "interleaved"],
        pp_values=[4, 8, 16, 32, 64],
        micro_batches=[1, 2, 4, 8, 16, 32],
    )
    run(
        "The default tune command: GPT3-13B, 64 × A100-40G, global batch 128, every scheme, tp and cp searched",
        "gpt3-13b",
        "a100-40g",
        64,
        128,
        10,
        jobs,
        splits=model_splits(load_model("gpt3-13b"), 64, load_hardware("a100-40g").gpus_per_node),
    )
    result = run(
        "1024 devices: GPT3-175B, 1024 × A100-80G (8 a node), tp and cp searched, global batch 1536",
        "gpt3-175b",
        "a100-80g",
        1024,
        1536,
        30,
        jobs,
        splits=model_splits(load_model("gpt3-175b"), 1024, load_hardware("a100-80g").gpus_per_node),
        pp_values=[2, 4, 8, 16, 32, 64, 128],
        micro_batches=[1, 2, 4, 8, 16],
    )
    tp = result.best.candidate.split.tp
    print(f"  its tp = {tp}: {'inside' if tp <= 8 else 'across'} a node of 8")
    command_line(jobs)
    if not quick:
        long_sequences(jobs)


def command_line(jobs: int) -> None:
    """The default command as a user types it: a fresh interpreter, the search, plan.json and
    the timeline's PNG (matplotlib's import and drawing included)."""
    with tempfile.TemporaryDirectory() as directory:
        command = [sys.executable, "-m", "pipeloom", "tune", "--model", "gpt3-13b", "--devices", "64"]
        command += ["--memory", "40GiB", "--global-batch", "128", "--hardware", "a100-40g", "--quiet"]
        command += ["--jobs", str(jobs), "--output", str(Path(directory) / "plan.json")]
        began = time.perf_counter()
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        seconds = time.perf_counter() - began
    print("\nThe default command from a shell: pipeloom tune --model gpt3-13b --devices 64 --memory 40GiB ...")
    print(
        f"  wall time {seconds:.2f} s with start-up, plan.json and plan.png (goal ≤ 10 s: {'met' if seconds <= 10 else 'missed'})"
    )


if __name__ == "__main__":
    main()
