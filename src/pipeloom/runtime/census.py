"""What a rank holds, counted from the objects themselves: every tensor reachable from its run.

The static report (`static_report`) reads the optimizers' own accounting; a stray copy — a full
weight kept beside its shard, a cast kept for a report — would not show there. The census walks
the rank's objects instead (modules and their hooks' closures, optimizers, buckets, stores, every
runtime object) and adds up the storage under each tensor it meets, each storage once, sorted by
what holds it:

* `buffers` — the model's buffers (rotary frequencies, position ids), which the plan leaves out;
* `messages` — the mailboxes' receive buffers (activations, which the plan prices apart);
* `reports` — what the rank has gathered to report (`RankResult`);
* `scalars` — one-element tensors (AdamW's step counters, a loss scale);
* `indices` — integer and boolean tensors (a device mesh's ranks, ZeRO's ownership mask);
* `parameters` — everything else: weights, gradients, optimizer state, and any copy that should
  not be there. A rank holding exactly its part has `parameters` equal to the plan's static bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

__all__ = ["HeldBytes", "census", "peak_resident_bytes"]

_WALKED_PACKAGES = ("pipeloom", "torch", "transformers", "collections", "functools", "builtins", "threading")


@dataclass
class HeldBytes:
    parameters: int = 0
    buffers: int = 0
    messages: int = 0
    reports: int = 0
    scalars: int = 0
    indices: int = 0

    def to_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def census(run) -> HeldBytes:
    """The bytes a `RankRun` holds, by what holds them (see the module docstring)."""
    held = HeldBytes()
    counted: set[tuple[str, int]] = set()
    visited: dict[int, object] = {}  # the objects themselves: a freed one's id could be reused

    def add(category: str, root: object) -> None:
        for tensor in _tensors(root, visited):
            if tensor.is_meta or not hasattr(tensor, "untyped_storage"):
                continue
            storage = tensor.untyped_storage()
            key = (str(tensor.device), storage.data_ptr())  # a host and a device address may coincide
            if key in counted or storage.nbytes() == 0:
                continue
            counted.add(key)
            which = category
            if tensor.numel() <= 1 and storage.nbytes() <= 8:
                which = "scalars"
            elif not (tensor.is_floating_point() or tensor.is_complex()):
                which = "indices"
            setattr(held, which, getattr(held, which) + storage.nbytes())

    add("buffers", [buffer for module in run.model.stages.values() for buffer in module.buffers()])
    evaluation = run.services.evaluation
    add("messages", [run.groups.mail, evaluation.executor.mail if evaluation is not None else None])
    add("reports", run.result)
    add("parameters", _attributes(run))
    return held


def _tensors(root: object, visited: dict[int, object]) -> Iterator[torch.Tensor]:
    """Every tensor reachable from `root` through containers, object attributes, closures and
    bound methods, each object visited once (across calls sharing `visited`)."""
    stack = [root]
    while stack:
        item = stack.pop()
        if item is None or id(item) in visited:
            continue
        visited[id(item)] = item
        if isinstance(item, torch.Tensor):
            yield item
            if item.is_leaf:
                stack.extend(value for value in (item.grad, getattr(item, "main_grad", None)) if value is not None)
            continue
        if isinstance(item, (str, bytes, int, float, bool, complex, type, types.ModuleType)):
            continue
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)) or type(item).__name__ == "deque":
            stack.extend(cast(Iterable, item))
        elif isinstance(item, types.FunctionType):
            stack.extend(cell.cell_contents for cell in item.__closure__ or () if _filled(cell))
            stack.extend(item.__defaults__ or ())
        elif isinstance(item, types.MethodType):
            stack.extend((item.__self__, item.__func__))
        elif isinstance(item, functools.partial):
            stack.extend((item.func, item.args, item.keywords))
        elif isinstance(item, torch.optim.Optimizer):
            stack.extend((item.state, item.param_groups))
        elif isinstance(item, nn.Module) or _walked(item):
            stack.extend(_attributes(item))


def _filled(cell) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _walked(item: object) -> bool:
    return type(item).__module__.split(".")[0] in _WALKED_PACKAGES


def _attributes(item: object) -> list:
    values = list(getattr(item, "__dict__", {}).values())
    for cls in type(item).__mro__:
        for slot in getattr(cls, "__slots__", ()):
            if hasattr(item, slot):
                values.append(getattr(item, slot))
    return values


def peak_resident_bytes() -> int:
    """This process's peak resident set (VmHWM), bytes; 0 where the kernel does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
