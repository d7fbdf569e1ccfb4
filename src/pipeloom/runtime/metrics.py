"""What a trainer prints: per step loss, step time, tokens/s, achieved TFLOP/s and MFU; a table at
the end. FLOPs are model FLOPs — three times the forward's matrix products, convolutions and
attention, counted once by torch's FlopCounterMode on an example micro-batch — so recomputation
does not inflate them. That is not quite PaLM's count (6N + 12·L·H·Q·T a token): the input
embedding is a lookup and counts nothing, and attention counts only where the counter sees its
kernel (not on a CPU's fused attention), so the table says which count it gives
(`FLOP_COUNT`); `bench/gpu.py` prints both. MFU needs a peak: `--peak-tflops` or a `--hardware`
preset's 16-bit peak; without one it is left out rather than guessed.
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Sequence

__all__ = ["FLOP_COUNT", "StepReporter", "throughput", "final_table"]

FLOP_COUNT = (
    "TFLOP/s and MFU count model FLOPs: 3 × the forward's matrix products as torch's FlopCounterMode sees them "
    "(no input-embedding lookup; attention only where the counter sees its kernel) — PaLM's 6N + 12·L·H·Q·T is "
    "higher by the embedding's 6·V·H and any attention left out"
)


def throughput(result, seconds: float, peak_tflops: float | None) -> dict:
    """Tokens/s of the whole run and this rank's TFLOP/s and MFU for a step of `seconds`."""
    tokens = result.samples_per_step * result.sample_tokens
    tflops = 3 * result.forward_flops / seconds / 1e12 if seconds > 0 else 0.0
    return {
        "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
        "tflops": tflops,
        "mfu": tflops / peak_tflops if peak_tflops else None,
    }


class StepReporter:
    """Rank 0's live line: a tqdm bar on a terminal, one printed line per step otherwise."""

    def __init__(self, result, steps: int, peak_tflops: float | None) -> None:
        self.result, self.peak = result, peak_tflops
        self.bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=steps, desc="train", unit="step", file=sys.stderr, leave=True)

    def __call__(self, step: int | None) -> None:
        if step is None:
            if self.bar is not None:
                self.bar.close()
            return
        seconds = self.result.step_seconds[-1]
        facts = throughput(self.result, seconds, self.peak)
        unit = "tokens/s" if self.result.sample_tokens > 1 else "samples/s"
        parts = [
            f"loss {self.result.losses[-1]:.4f}",
            f"{seconds * 1e3:.1f} ms",
            f"{facts['tokens_per_second']:,.0f} {unit}",
            f"{facts['tflops']:.4g} TFLOP/s (rank 0)",
        ]
        if facts["mfu"] is not None:
            parts.append(f"MFU {facts['mfu']:.1%}")
        if self.result.learning_rates and self.result.learning_rates[-1] is not None:
            parts.append(f"lr {self.result.learning_rates[-1]:.3g}")
        if self.result.loss_scales:
            parts.append(f"loss scale {self.result.loss_scales[-1]:g}")
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(parts), refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}: " + "  ".join(parts), flush=True)


def final_table(results: Sequence, facts: dict) -> str:
    """Per rank: median step, TFLOP/s, MFU, peak stash, (GPU) peak memory, bytes sent (between
    stages; with tensor parallelism also in the group's collectives; with expert parallelism the
    all-to-alls' bytes, time in flight (hidden under pairs) and the busiest expert's load over the
    mean), and the optimizer's bytes on the device, measured beside planned."""
    tensor_parallel = facts.get("tp", 1) > 1
    context_parallel = facts.get("cp", 1) > 1
    experts = facts.get("ep", 1) > 1
    lines = [
        f"{'rank':>4}  {'step ms':>9}  {'TFLOP/s':>8}  {'MFU':>6}  {'stash MiB':>10}  "
        f"{'GPU peak MiB':>12}  {'sent MiB/step':>13}  {'optimizer MiB (plan)':>20}"
        + (f"  {'TP MiB/step':>11}" if tensor_parallel else "")
        + (f"  {'K/V MiB/step':>12}" if context_parallel else "")
        + (f"  {'a2a MiB/step':>12}  {'a2a ms (hidden)':>16}  {'expert load':>11}" if experts else "")
    ]
    for result, rank in zip(results, facts["ranks"]):
        mfu = f"{rank['mfu']:.1%}" if rank["mfu"] is not None else "n/a"
        gpu = f"{rank['peak_memory_bytes'] / 2**20:.1f}" if rank["peak_memory_bytes"] is not None else "n/a"
        lines.append(
            f"{result.rank:>4}  {rank['median_step_seconds'] * 1e3:>9.1f}  {rank['tflops']:>8.4g}  {mfu:>6}  "
            f"{rank['peak_stash_bytes'] / 2**20:>10.2f}  {gpu:>12}  {rank['sent_bytes_per_step'] / 2**20:>13.2f}  "
            f"{_optimizer_cell(rank):>20}"
            + (f"  {rank['tp_sent_bytes_per_step'] / 2**20:>11.2f}" if tensor_parallel else "")
            + (f"  {rank['kv_sent_bytes_per_step'] / 2**20:>12.2f}" if context_parallel else "")
            + (_expert_cells(rank) if experts else "")
        )
    unit = "tokens/s" if facts["sample_tokens"] > 1 else "samples/s"
    lines.append(FLOP_COUNT)
    lines.append(
        f"median step {facts['median_step_seconds'] * 1e3:.1f} ms, {facts['tokens_per_second']:,.0f} {unit}, "
        f"final loss {facts['losses'][-1]:.4f}"
        if facts["losses"]
        else ""
    )
    return "\n".join(lines)


def _expert_cells(rank: dict) -> str:
    if "a2a_ms_per_step" not in rank:
        return ""
    timing = f"{rank['a2a_ms_per_step']:.1f} ({rank['a2a_hidden_ms_per_step']:.1f})"
    return f"  {rank['a2a_sent_bytes_per_step'] / 2**20:>12.3f}  {timing:>16}  {rank['expert_load_imbalance']:>10.2f}×"


def _optimizer_cell(rank: dict) -> str:
    measured, planned = rank.get("static_bytes") or {}, rank.get("planned_static_bytes") or {}
    if "optimizer" not in measured:
        return "n/a"
    return f"{measured['optimizer'] / 2**20:.2f} ({planned.get('optimizer', 0) / 2**20:.2f})"


def median_step(result) -> float:
    times = result.step_seconds[1:] or result.step_seconds
    return statistics.median(times) if times else 0.0
