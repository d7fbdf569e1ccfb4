"""A Hugging Face directory's saved weights as a source of values for `materialise`: each rank reads
only its tensors, and of those only its slices.

A checkpoint does not always name its tensors as the model does: a mixture of experts saves each
expert's matrices apart (Mixtral's `block_sparse_moe.experts.3.w1.weight`), which the library
renames and stacks into the model's `mlp.experts.gate_up_proj` as it loads, by the family's
conversion mapping (`transformers.conversion_mapping`). `ConvertedWeights` follows that same
mapping — renamings, then per-expert tensors merged along a new expert dimension and, for a fused
gate/up, concatenated — reading only the experts a rank's slice holds. A mapping with any other
operation, or a directory whose names still do not match (a base model saved without its head's
prefix), is loaded whole by the library, once, on each rank that needs it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import cast

import torch

from pipeloom.errors import ConfigError
from pipeloom.models.compat import import_transformers
from pipeloom.models.materialise import Cut, LoadedWeights, WeightFiles

__all__ = ["ConvertedWeights", "weights_of"]


class ConvertedWeights:
    """The files' tensors under the model's names, converted as the library would (see the module
    docstring); the interface of `WeightFiles`."""

    def __init__(self, raw: WeightFiles, renamings: list[tuple[str, str]], stacked: list[tuple[list[str], str]]):
        """`renamings`: (pattern, replacement) applied to every saved name in turn; `stacked`:
        (per-expert source patterns, with `*` for the expert; the stacked target's suffix)."""
        self.raw = raw
        self.saved: dict[str, str] = {}
        """A name after the renamings → the name in the files."""
        for key in raw.files:
            renamed = key
            for pattern, replacement in renamings:
                renamed = re.sub(pattern, replacement, renamed)
            self.saved[renamed] = key
        self.files: dict[str, list[list[str]]] = {}
        """The model's name → per source pattern, the files' names of each expert's tensor (for
        a stacked one; a plain one maps to its own file name, one pattern, one expert)."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        for renamed, key in self.saved.items():
            self.files[renamed] = [[key]]
            self.shapes[renamed] = raw.shapes[key]
        for sources, target in stacked:
            for renamed in list(self.saved):
                found = re.fullmatch(r"(.*)" + re.escape(sources[0]).replace(r"\*", r"0"), renamed)
                if found is None:
                    continue
                prefix, keys = found.group(1), cast(list[list[str]], [])
                for source in sources:
                    keys.append([])
                    while (name := prefix + source.replace("*", str(len(keys[-1])))) in self.saved:
                        keys[-1].append(self.saved[name])
                if len({len(k) for k in keys}) != 1:
                    continue
                first = [raw.shapes[k[0]] for k in keys]
                self.files[prefix + target] = keys
                self.shapes[prefix + target] = (len(keys[0]), sum(s[0] for s in first), *first[0][1:])

    def read(self, name: str, cut: Cut | None, dtype: torch.dtype) -> torch.Tensor:
        keys = self.files[name]
        if len(keys) == 1 and len(keys[0]) == 1 and name in self.saved:
            return self.raw.read(keys[0][0], cut, dtype)
        experts = range(len(keys[0]))
        if cut is not None and cut.dim == 0 and cut.parts == 1:  # an expert-parallel slice: its experts only
            width = len(experts) // cut.count
            experts, cut = range(cut.index * width, (cut.index + 1) * width), None
        stacked = torch.cat([torch.stack([self.raw.read(k[e], None, dtype) for e in experts]) for k in keys], dim=1)
        return cut.of(stacked).clone() if cut is not None else stacked


def weights_of(path: str | Path, config, names: set[str], family: str, options: dict):
    """The directory's saved weights as a source of values: read tensor by tensor (and slice by
    slice) when the files name every parameter as the model does, or do after the family's
    conversion; else loaded whole by the library. A file the library cannot read (truncated,
    corrupt, from another config) is refused naming the directory and its weight files, not as a
    library trace."""
    files = ", ".join(sorted(p.name for p in Path(path).glob("*.safetensors")))
    try:
        raw = WeightFiles(Path(path))
        if names <= set(raw.files):
            return raw
        converted = _converted(raw, family)
        if converted is not None and names <= set(converted.files):
            return converted
        transformers = import_transformers()
        auto = transformers.AutoModelForMaskedLM if config.model_type == "bert" else transformers.AutoModelForCausalLM
        model = auto.from_pretrained(str(path), config=config, local_files_only=True, dtype=torch.float32, **options)
        return LoadedWeights({name: t.detach() for name, t in model.named_parameters()})
    except Exception as error:  # noqa: BLE001 - safetensors, OSError, size mismatches: all one cause
        reason = str(error).strip()
        why = f"{type(error).__name__}: {reason.splitlines()[0] if reason else ''}"
        raise ConfigError(f"hf: cannot load the weights in {str(path)!r} ({files}): {why}") from None


def _converted(raw: WeightFiles, family: str) -> ConvertedWeights | None:
    """The family's conversion mapping as renamings and stacks, or None when it uses another
    operation (the library then loads the directory whole)."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    renamings: list[tuple[str, str]] = []
    stacked: list[tuple[list[str], str]] = []
    for step in get_checkpoint_conversion_mapping(family) or []:
        sources, targets = list(step.source_patterns), list(step.target_patterns)
        operations = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(step, "operations", [])]
        if type(step).__name__ == "WeightRenaming" and len(sources) == len(targets):
            renamings.extend(zip(sources, targets))
        elif (
            operations in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) and len(targets) == 1
        ):
            if len(sources) > 1 and len(operations) == 1:
                return None
            stacked.append((sources, targets[0]))
        else:
            return None
    return ConvertedWeights(raw, renamings, stacked) if stacked or renamings else None
