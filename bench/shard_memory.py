"""What each rank holds: a 128M-parameter Hugging Face LLaMA (hidden 1024, 8 layers) trained for two
steps on the token file at pp 1, pp 2 and pp 2 × tp 2 (forked gloo ranks on this machine).

Every rank builds the model on the meta device and makes real only its stages and shards, so
tensor parallelism should shrink the largest rank by about what it divides: the goal is the
largest pp 2 × tp 2 rank ≤ 0.75 × the largest pp 2 × tp 1 rank, measured by each rank process's
peak resident memory (VmHWM; it includes the ~0.3 GiB every torch process starts with). Beside it,
the static bytes the rank's objects hold (`census`) and the plan's static bytes for that rank.
Each layout runs in a fresh launcher process: a forked rank starts with its parent's resident
pages, so one launcher reused across layouts would lend the later ranks the earlier results.

    python bench/shard_memory.py [--steps 2] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pipeloom import build_schedule
from pipeloom.data import TokenFile
from pipeloom.runtime import TrainSpec, hf_workload, run_local

CONFIG = {
    "model_type": "llama",
    "vocab_size": 12288,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 1024,
}
LAYOUTS = {"pp 1": (1, 1), "pp 2": (2, 1), "pp 2 × tp 2": (2, 2)}
MIB = 1 << 20


def run_layout(label: str, steps: int, seq_len: int) -> dict:
    """One layout's ranks (forked from this process): the largest rank's figures."""
    pp, tp = LAYOUTS[label]
    directory = Path(tempfile.mkdtemp())
    (directory / "config.json").write_text(json.dumps(CONFIG))
    data = TokenFile(Path(__file__).parent.parent / "examples" / "train.bin", seq_len, seed=0)
    work = hf_workload(directory, seed=0, microbatch_size=1, seq_len=seq_len, data=data)
    schedule = build_schedule("1f1b", pp, 2) if pp > 1 else build_schedule("gpipe", 1, 2)
    results = run_local(TrainSpec(schedule, workload=work, steps=steps, lr=1e-4, tp=tp, threads=1))
    top = max(results, key=lambda r: r.peak_host_bytes)
    parameters = sum(t.numel() for stage in work.skeleton(1).stages for t in stage.parameters())  # meta
    return {
        "parameters": parameters,
        "peak": top.peak_host_bytes,
        "held": top.held_bytes["parameters"],
        "planned": sum(top.planned_static_bytes.values()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--layout", choices=list(LAYOUTS), help=argparse.SUPPRESS)  # one layout, as JSON
    args = parser.parse_args()
    if args.layout:
        print(json.dumps(run_layout(args.layout, args.steps, args.seq_len)))
        return
    figures = {}
    for label in LAYOUTS:
        command = [
            sys.executable,
            __file__,
            "--layout",
            label,
            "--steps",
            str(args.steps),
            "--seq-len",
            str(args.seq_len),
        ]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        figures[label] = json.loads(done.stdout.strip().splitlines()[-1])
    parameters = figures["pp 1"]["parameters"]
    print(f"model: {parameters / 1e6:.1f}M parameters (fp32 AdamW: {16 * parameters / MIB:,.0f} MiB of static state)")
    print(f"{'layout':<13}{'largest rank peak RSS':>24}{'held static':>14}{'planned static':>16}")
    for label, row in figures.items():
        peak, held, planned = (row[key] / MIB for key in ("peak", "held", "planned"))
        print(f"{label:<13}{peak:>20,.0f} MiB{held:>10,.0f} MiB{planned:>12,.0f} MiB")
    ratio = figures["pp 2 × tp 2"]["peak"] / figures["pp 2"]["peak"]
    print(f"largest pp 2 × tp 2 rank / largest pp 2 rank: {ratio:.2f} (goal ≤ 0.75)")


if __name__ == "__main__":
    main()
