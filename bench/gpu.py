"""The check anyone with one GPU runs: pipeloom on a GPU against a plain Hugging Face loop.

Nothing to download: the models are LLaMA configs this script writes (random weights, synthetic
tokens — speed and memory do not depend on the values). Every pipeloom run is in one process on
the one GPU (`run_in_process`: p stages and no transport), bf16 autocast over fp32 master weights,
fused AdamW, as the plain loop. One table, rows by what they check:

  (a) p = 1 against the plain loop, eager and compiled (`--compile`; the loop: `torch.compile(model)`);
  (b) 1f1b, zb-h1, zb-v and interleaved with p = 4 in process against p = 1 1f1b, the same
      micro-batches: what the executor's ops cost on top of the same compute;
  (c) the split backward at p = 1: zb-h1 (its W folded into B: nothing to fill) and zb-h1 with
      every W kept apart (`separate_w`), against 1f1b;
  (d) peak GPU memory (torch.cuda.max_memory_allocated) against the plan: the weights, gradients
      and optimizer state pipeloom plans for the rank, plus the activations the simulator
      holds at once (one micro-batch's autograd stash per stage, from the probe) — p = 1 rows;
  (f) with --profile: `pipeloom profile --device cuda` in this process (every probe stage on the
      GPU, ops timed by CUDA events), its fitted forward and fused backward (F_BW and BW: a
      plain loop's linears are ordinary, its backward one autograd pass; and beside them the
      split ones, F and B + W) of the first stage of n layers against the same stage's forward
      and backward in a plain loop timed by torch.cuda.Event — the profile's op times should be
      the GPU's own within 3 %;
  (e) MFU, PaLM's count (Chowdhery et al. 2022, app. B): 6N + 12·L·H·Q·T FLOPs a token, N every
      parameter (the input embedding included), L layers, H·Q the hidden size, T the sequence —
      beside pipeloom's own report's count (3 × the forward's matrix products as torch's
      FlopCounterMode sees them: no embedding lookup, attention only where the counter sees it).

Step times are medians over the steps after the warm-up (compilation happens in the first).
Goals on an H100/H200: p = 1 --compile ≤ 1.0 × the compiled loop; zb-h1 at p = 1 ≤ 1.02 × 1f1b;
p = 4 in process ≤ 1.05 × p = 1; peak memory within 5 % of the plan; MFU (PaLM) ≥ 45 %.

Usage: python bench/gpu.py [--quick] [--split-compile] [--profile] [--json PATH] [--peak-tflops T]
       (--quick: the 2-minute subset on a ~130M model, eager only;
        --split-compile: also p = 4 zb-v compiled both ways a split backward survives compilation —
        pipeloom's custom op (one graph a stage) and a graph break at each linear — a few minutes more;
        --smoke: a tiny model on whatever device there is — checks this script, measures nothing)
Never in CI.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from compiled_stages import graph_breaks_at_split_linears  # bench/ is on the path

from pipeloom import Costs, build_schedule, simulate
from pipeloom.models.hf import hf_workload
from pipeloom.runtime.in_process import run_in_process
from pipeloom.runtime.metrics import throughput
from pipeloom.runtime.probe import probe_spec
from pipeloom.runtime.training import TrainSpec

MODELS = {  # a LLaMA config, and the run's shape: micro-batches m of b sequences of seq tokens
    "0.9b": (dict(hidden_size=2048, intermediate_size=5120, num_hidden_layers=16, num_attention_heads=16), 8, 2, 2048),
    "130m": (dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12), 8, 4, 1024),
    "tiny": (dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4), 4, 2, 64),
}
PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}
"""Dense bf16 peaks (SXM parts), by the name torch reports."""


@dataclass
class Row:
    check: str
    what: str
    step_ms: float
    baseline: str = ""
    ratio: float | None = None
    tokens_per_s: float = 0.0
    palm_tflops: float = 0.0
    mfu: float | None = None
    report_tflops: float | None = None
    peak_gib: float | None = None
    plan_gib: float | None = None
    seconds: float = 0.0
    """Wall time of the whole run, set-up and compilation included."""


class Bench:
    def __init__(self, model: str, device: str, dtype: str, peak_tflops: float | None, steps: tuple[int, int]):
        config, self.m, self.b, self.seq = MODELS[model]
        self.config = {
            "model_type": "llama",
            "vocab_size": 32000 if model != "tiny" else 256,
            "num_key_value_heads": config["num_attention_heads"],
            "max_position_embeddings": self.seq,
            "tie_word_embeddings": False,
            **config,
        }
        self.directory = Path(tempfile.mkdtemp(prefix="pipeloom-gpu-")) / model
        self.directory.mkdir()
        (self.directory / "config.json").write_text(json.dumps(self.config))
        self.device, self.dtype, self.peak = device, dtype, peak_tflops
        self.warm, self.measured = steps
        self.rows: list[Row] = []
        self.parameters = _parameter_count(self.config)
        h, layers = self.config["hidden_size"], self.config["num_hidden_layers"]
        self.flops_per_token = 6 * self.parameters + 12 * layers * h * self.seq

    @property
    def tokens(self) -> int:
        return self.m * self.b * self.seq

    def spec(self, name: str, p: int, **changes) -> TrainSpec:
        extra = {"num_chunks": 2} if name == "interleaved" else {}
        work = hf_workload(self.directory, seed=0, microbatch_size=self.b, seq_len=self.seq)
        return TrainSpec(
            build_schedule(name, p, self.m, **extra),
            workload=work,
            steps=self.warm + self.measured,
            dtype=self.dtype,
            device=self.device,
            backend="nccl" if self.device == "cuda" else "gloo",
            return_parameters=False,
            **changes,
        )

    def pipeloom(self, check: str, what: str, name: str, p: int, baseline: str = "", plan: bool = False, **changes):
        began = time.perf_counter()
        spec = self.spec(name, p, **changes)
        results = run_in_process(spec)
        seconds = statistics.median(results[0].step_seconds[self.warm :])
        row = self._row(check, what, seconds, baseline, time.perf_counter() - began)
        row.report_tflops = sum(throughput(r, seconds, None)["tflops"] for r in results)
        if self.device == "cuda":
            row.peak_gib = max(r.peak_memory_bytes or 0 for r in results) / 2**30
        if plan:
            row.plan_gib = _planned_bytes(spec, results) / 2**30
        del results
        _release()
        return self._add(row)

    def plain_loop(self, check: str, what: str, compiled: bool, baseline: str = ""):
        """The five lines a user writes: fp32 weights, bf16 autocast, fused AdamW, m micro-batches."""
        import transformers

        began = time.perf_counter()
        config = transformers.AutoConfig.for_model(**self.config)
        torch.manual_seed(0)
        with torch.device(self.device):
            model = transformers.AutoModelForCausalLM.from_config(config)  # fp32, torch's default
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=self.device == "cuda")
        forward = torch.compile(model) if compiled else model
        tokens = torch.randint(0, self.config["vocab_size"], (self.m, self.b, self.seq), device=self.device)
        compute = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        if self.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(self.warm + self.measured):
            start = time.perf_counter()
            for micro in tokens:
                with torch.autocast(self.device, dtype=compute, enabled=compute != torch.float32):
                    loss = forward(input_ids=micro, labels=micro).loss / self.m
                loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if self.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        row = self._row(check, what, statistics.median(times[self.warm :]), baseline, time.perf_counter() - began)
        if self.device == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
        del model, optimizer, forward, loss
        _release()
        return self._add(row)

    def _row(self, check: str, what: str, seconds: float, baseline: str, wall: float) -> Row:
        tflops = self.flops_per_token * self.tokens / seconds / 1e12
        row = Row(check, what, seconds * 1e3, baseline, tokens_per_s=self.tokens / seconds, palm_tflops=tflops)
        row.mfu = tflops / self.peak if self.peak else None
        row.seconds = wall
        return row

    def _add(self, row: Row) -> Row:
        if row.baseline:
            base = next(r for r in self.rows if r.what == row.baseline)
            row.ratio = row.step_ms / base.step_ms
        self.rows.append(row)
        print(_line(row), flush=True)
        return row


def _parameter_count(config: dict) -> int:
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    return sum(t.numel() for t in model.parameters())


def _planned_bytes(spec: TrainSpec, results) -> float:
    """What pipeloom plans a rank of a p = 1 run to hold: its static bytes (weights, gradients,
    optimizer state on the device) and the activations the simulator holds at once."""
    static = sum(v for k, v in results[0].planned_static_bytes.items() if k != "host")
    probe = probe_spec(spec)
    timeline = simulate(spec.schedule, Costs(F=1.0, B=2.0, W=1.0, M_B=list(probe.stash_bytes)))
    return static + max(timeline.peak_memory)


def _release() -> None:
    """Let the next run start from an empty GPU: compiled graphs (dynamo's caches) go too."""
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


HEADER = (
    f"{'':3} {'run':<38} {'step ms':>8} {'× base':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} "
    f"{'report TF/s':>11} {'peak GiB':>8} {'plan GiB':>8} {'wall s':>6}"
)


def _line(row: Row) -> str:
    def cell(value, spec, width):
        return f"{value:{spec}}".rjust(width) if value is not None else "—".rjust(width)

    return (
        f"{row.check:3} {row.what:<38} {row.step_ms:>8.1f} {cell(row.ratio, '.3f', 7)} {row.tokens_per_s:>9,.0f} "
        f"{row.palm_tflops:>8.3g} {cell(row.mfu, '.1%', 6)} {cell(row.report_tflops, '.3g', 11)} "
        f"{cell(row.peak_gib, '.2f', 8)} {cell(row.plan_gib, '.2f', 8)} {row.seconds:>6.0f}"
    )


def profile_against_a_plain_loop(device: str, smoke: bool) -> None:
    """(f): the profile's op times on this device against the same ops in a plain loop."""
    from pipeloom.models.llama import build_stages, llama_config
    from pipeloom.profile.profiler import profile_model
    from pipeloom.runtime.clocks import clock_for
    from pipeloom.tune.presets import ModelSpec

    model = (
        ModelSpec("tiny", hidden=64, layers=4, heads=4, ffn=128, vocab=256, seq_len=64, gated=True)
        if smoke
        else ModelSpec("llama-0.3b", hidden=1024, layers=8, heads=16, ffn=2816, vocab=32000, seq_len=1024, gated=True)
    )
    sizes, counts = (1, 2), (1, 2)
    began = time.perf_counter()
    profile = profile_model(model, sizes, counts, steps=4, max_rounds=3, device=device, allow_busy=not smoke)
    print(f"\n(f) profile --device {device}: {time.perf_counter() - began:.0f} s; {profile.device.description}")
    print(f"{'op of the first stage':<34}{'profile ms':>12}{'plain loop ms':>15}{'ratio':>8}")
    clock, where = clock_for(torch.device(device)), torch.device(device)
    torch.set_num_threads(1)  # on a CPU, as the profile's ranks run (its default --threads)
    for mbs in sizes:
        for layers in counts:
            stage = build_stages(llama_config(model, 2 * layers, mbs), 2, seed=0)[0].to(where)
            tokens = torch.randint(0, model.vocab, (mbs, model.seq_len), device=where)
            forward, backward = [], []
            for _ in range(12):
                a = clock.mark()
                out = stage(tokens)
                b = clock.mark()
                out.float().square().mean().backward()
                c = clock.mark()
                forward.append((a, b))
                backward.append((b, c))
            if where.type == "cuda":
                torch.cuda.synchronize()
            fits = profile.plain.fits[mbs]
            pairs = (("F_BW", forward, ("F_BW",)), ("BW", backward, ("BW",)))
            pairs += (("F (split)", forward, ("F",)), ("B + W (split)", backward, ("B", "W")))
            for name, marks, kinds in pairs:
                loop = statistics.median(1e3 * clock.seconds(x, y) for x, y in marks[2:])
                fitted = sum(fits[kind].per_layer * layers + fits[kind].at("first") for kind in kinds)
                print(f"{f'{name}, mbs {mbs}, {layers} layer(s)':<34}{fitted:>12.3f}{loop:>15.3f}{fitted / loop:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the 2-minute subset: a ~130M model, eager only")
    parser.add_argument("--smoke", action="store_true", help="a tiny model on any device: checks the script")
    parser.add_argument(
        "--split-compile", action="store_true", help="also p=4 zb-v compiled as one graph a stage and with breaks"
    )
    parser.add_argument(
        "--profile", action="store_true", help="also (f): `profile --device cuda` against a plain loop's events"
    )
    parser.add_argument("--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: by its name)")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        parser.error("no CUDA GPU here; --smoke runs the script on this machine's CPU")
    device = "cuda" if cuda else "cpu"
    name = torch.cuda.get_device_name() if cuda else "CPU"
    peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    model = "tiny" if args.smoke else "130m" if args.quick else "0.9b"
    bench = Bench(model, device, "bf16" if cuda else "fp32", peak, (1, 2) if args.smoke else (3, 5))
    began = time.perf_counter()
    print(
        f"{name}, torch {torch.__version__}; LLaMA {bench.parameters / 1e6:,.1f}M parameters, {bench.m} micro-batches "
        f"of {bench.b} × {bench.seq} tokens, {bench.dtype}; MFU against {peak or 'no'} TFLOP/s "
        f"(PaLM count: {bench.flops_per_token / 1e9:.2f} GFLOP a token)\n"
    )
    print(HEADER)
    compiled = not args.quick
    bench.plain_loop("a", "HF loop, eager", compiled=False)
    if compiled:
        bench.plain_loop("a", "HF loop, torch.compile(model)", compiled=True)
    bench.pipeloom("a", "p=1 1f1b", "1f1b", 1, baseline="HF loop, eager", plan=True)
    if compiled:
        bench.pipeloom(
            "a", "p=1 1f1b --compile", "1f1b", 1, baseline="HF loop, torch.compile(model)", plan=True, compile=True
        )
    bench.pipeloom("c", "p=1 zb-h1 (W folded into B)", "zb-h1", 1, baseline="p=1 1f1b", plan=True)
    bench.pipeloom("c", "p=1 zb-h1, every W apart", "zb-h1", 1, baseline="p=1 1f1b", separate_w=True)
    for schedule in ("1f1b", "zb-h1", "zb-v", "interleaved") if not args.quick else ("1f1b", "zb-v"):
        bench.pipeloom("b", f"p=4 {schedule} in process", schedule, 4, baseline="p=1 1f1b")
    if args.split_compile:
        bench.pipeloom("b", "p=4 zb-v --compile", "zb-v", 4, baseline="p=4 zb-v in process", compile=True)
        with graph_breaks_at_split_linears():
            what = "p=4 zb-v --compile, breaks at linears"
            bench.pipeloom("b", what, "zb-v", 4, baseline="p=4 zb-v in process", compile=True)
    if args.profile:
        profile_against_a_plain_loop(device, args.smoke)
    print(f"\n{time.perf_counter() - began:.0f} s in all")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(row) for row in bench.rows], indent=1))


if __name__ == "__main__":
    main()
