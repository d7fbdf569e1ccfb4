"""A checkpoint as a transformers model directory: config.json and safetensors, loadable with
`AutoModelForCausalLM.from_pretrained`.

Checkpoints key every weight by its name in the whole model (`models.workload.global_names`; a
Hugging Face stage's are the library's own), and DCP reads any saved layout into any other: so
the export builds the model once from the configuration the run recorded (``model.json``), loads
the checkpoint's weights straight into its parameters — whatever schedule, pipeline size,
data-parallel size, ZeRO level or tensor-parallel cut wrote them (DCP joins a DTensor's shards) —
and saves it with the library's `save_pretrained`, which writes a tied weight once. The weights
are the fp32 masters: the parameters themselves, or — where the run kept its masters apart from
bf16 compute copies (ZeRO, host offload) — the `master.NAME` entries those optimizers save by name.
A tokenizer beside the source model is copied.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from pipeloom.errors import ConfigError
from pipeloom.models.compat import import_transformers
from pipeloom.runtime.checkpoint import MODEL, read_checkpoint

__all__ = ["export_checkpoint", "TOKENIZER_FILES"]

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def export_checkpoint(checkpoint: str | Path, output: str | Path, dtype: str = "fp32") -> Path:
    """Write the model of `checkpoint` (a step-N directory, or the newest in a --save directory)
    to `output`; return the checkpoint directory read. ConfigError if it cannot be exported."""
    chosen, facts = read_checkpoint(checkpoint)
    model_file = chosen / MODEL
    if not model_file.is_file() or not facts.get("layout_free"):
        raise ConfigError(
            f"export: checkpoint {str(chosen)!r} does not record its model by name (written by an older pipeloom "
            "or a model without whole-model names); it cannot be exported"
        )
    description = json.loads(model_file.read_text())
    if description.get("kind") != "hf":
        raise ConfigError(
            f"export: checkpoint {str(chosen)!r} holds {description.get('kind', 'a custom')!r} weights, which have no "
            "transformers class; train with --model hf:DIR to export"
        )
    model = _empty_model(description)
    stored = dcp.FileSystemReader(chosen).read_metadata().state_dict_metadata
    state = {  # a weight's fp32 master where the run kept one apart (ZeRO, offload), else the weight
        (f"master.{name}" if f"master.{name}" in stored else f"model.{name}"): parameter.data
        for name, parameter in model.named_parameters()
    }
    try:
        with warnings.catch_warnings():  # "torch.distributed is uninitialized": one process is the intent
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=chosen, no_dist=True)
    except (Exception, CheckpointException) as error:  # noqa: BLE001 - DCP wraps a missing or misshapen
        # tensor in its own types; a damaged file's reader error comes inside a CheckpointException (not an
        # Exception), as the last line of the traceback it carries
        lines = [line for line in str(error).strip().splitlines() if line.strip()] or [type(error).__name__]
        cause = (lines[-1] if isinstance(error, CheckpointException) else lines[0]).split(". ")[0]
        raise ConfigError(f"export: checkpoint {str(chosen)!r} is damaged or does not fit its model: {cause}") from None
    if dtype == "bf16":
        model = model.to(torch.bfloat16)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    # written beside it, then moved in file by file: an export cut short (Ctrl-C, a full disk)
    # leaves no half-written model under --output
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        model.save_pretrained(str(staging))
        _as_the_umask_allows(staging)
        source = Path(description.get("source") or "")
        source = source if source.is_dir() else source.parent
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, staging / name)
        for path in sorted(staging.iterdir(), key=lambda path: path.name == "config.json"):  # the marker last
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return chosen


def _empty_model(description: dict):
    """The transformers model of the recorded configuration (its own initial weights, replaced next)."""
    transformers = import_transformers()
    config = transformers.AutoConfig.for_model(**description["config"])
    family = description.get("family", config.model_type)
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    return auto.from_config(config, dtype=torch.float32)


def _as_the_umask_allows(directory: Path) -> None:
    """safetensors writes its files readable by their owner only (0600), whatever the umask; an
    exported model is meant to be shared and loaded like any file the user writes."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.glob("*.safetensors"):
        path.chmod(0o666 & ~mask)
