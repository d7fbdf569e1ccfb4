"""Refuse a model this machine cannot train before building it.

A config left to transformers' defaults (`{"model_type": "llama"}` alone is a 6.7 B-parameter
LLaMA) was built in fp32 on every CPU rank until memory ran out, silently. Its parameters are
counted on the meta device instead (no memory, a fraction of a second), and training needs at
least 16 bytes for each — fp32 weights, gradients and AdamW's two moments — before any
activation; the ranks of one launch share the machine, so the whole model is weighed against
what the machine has available.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = [
    "TRAINING_BYTES_PER_PARAM",
    "available_memory",
    "check_stash_fits",
    "check_trainable_here",
    "hf_parameter_count",
]

TRAINING_BYTES_PER_PARAM = 16
"""fp32 weights, fp32 gradients and AdamW's two fp32 moments: the least a trained parameter holds."""


def available_memory() -> int | None:
    """Bytes the kernel says a new process can use without swapping (MemAvailable); None where
    it does not say (not Linux)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def check_trainable_here(parameters: int, available: int | None = None, what: str = "the model") -> None:
    """ConfigError if `parameters` cannot even hold their weights and optimizer state in the
    machine's available memory (`available`, default: now)."""
    available = available_memory() if available is None else available
    need = TRAINING_BYTES_PER_PARAM * parameters
    if available is not None and need > available:
        raise ConfigError(
            f"{what} has {parameters / 1e9:.2f} B parameters: training them needs at least {need / 2**30:.1f} GiB "
            f"({TRAINING_BYTES_PER_PARAM} bytes each for fp32 weights, gradients and AdamW's moments, before any "
            f"activation) but this machine has {available / 2**30:.1f} GiB available; set a smaller config "
            "(hidden_size, num_hidden_layers, vocab_size — transformers' defaults are a full-size model)"
        )


def check_stash_fits(
    stash_bytes: float, sequences: int, tokens: int, replicas: int, available: int | None = None
) -> None:
    """ConfigError if one micro-batch's activations cannot be held at once on this machine.

    When the last stage runs micro-batch 0's backward, every earlier stage still holds what its
    forward of micro-batch 0 saved (its backward comes later), so whatever the schedule, the ranks
    hold at least `stash_bytes` (autograd's saved tensors of one micro-batch, summed over the
    stages) per data-parallel replica at once. A micro-batch far too large for the host (e.g.
    100,000 sequences) otherwise swaps for minutes before failing."""
    available = available_memory() if available is None else available
    need = stash_bytes * replicas
    if available is None or need <= available:
        return
    per_sequence = need / sequences
    fits = int(available // per_sequence)
    raise ConfigError(
        f"a micro-batch of {sequences:,} sequences × {tokens:,} tokens leaves {need / 2**30:.1f} GiB of activations "
        f"stashed across the stages{f' of {replicas} replicas' if replicas > 1 else ''} (each stage holds "
        "micro-batch 0's until its backward), "
        f"but this machine has {available / 2**30:.1f} GiB available: lower --microbatch-size"
        + (f" (at most {fits:,} sequences fit)" if fits else " (not even one sequence fits: shorten --seq-len)")
    )


def hf_parameter_count(config) -> int:
    """A transformers config's parameters, counted on the meta device: no memory, whatever the
    size (cached per config: tests and probes ask again)."""
    return _counted(config.to_json_string(use_diff=False))


@lru_cache(maxsize=64)
def _counted(config_json: str) -> int:
    import torch

    from pipeloom.models.compat import import_transformers

    transformers = import_transformers()
    config = transformers.AutoConfig.for_model(**json.loads(config_json))
    auto = transformers.AutoModelForMaskedLM if config.model_type == "bert" else transformers.AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(parameter.numel() for parameter in model.parameters())
