"""A model's stages built on the meta device, made real only where and as far as a rank holds them.

A rank of a pipeline hosts some stages, and under tensor or expert parallelism only its shard of
their weights. Building the whole model on every rank and cutting it afterwards costs each rank
the whole model's memory at set-up (and, on a GPU, a stage too big for one device could not be
cut at all). So a `Skeleton` is the model's stages on torch's meta device — shapes, no storage —
which the runtime selects and cuts as it would real ones (`Cut`: a shard along one dimension),
and then `materialise`s: every meta parameter and buffer the rank kept gets its real value, from
the model's saved weights (only the rank's slices are read, `safe_open(...).get_slice`) or from
its initialisation, and is swapped in place (`torch.utils.swap_tensors`: the objects stay those
the rank's optimizer, buckets and hooks know).

Initial values must be the same wherever they are made: every rank, and the single-process
reference (`Skeleton.whole`), whatever the cut. So a model initialises unit by unit — a stage's
children, each element of a `ModuleList` on its own (one decoder layer, the embedding, the head)
— each from its own seed (the run's seed and the unit's first parameter name in the whole model,
which no cut changes), running the model's own per-module rule (`PreTrainedModel._init_weights`)
over the unit's modules, children before parents, as the library's `initialize_weights` does. A
rank initialises only the units it needs — one at a time, on the host, kept as long as it takes
to cut its shard out of them. A tensor two units share (tied embeddings) takes its value from the
first unit holding it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipeloom.errors import ConfigError

__all__ = ["Cut", "Skeleton", "WeightFiles", "LoadedWeights", "materialise"]


@dataclass(frozen=True)
class Cut:
    """Shard `index` of `count` along `dim`; with `parts` > 1 the dimension holds that many packed
    blocks (GPT-2's fused q, k, v), each cut alike."""

    dim: int
    index: int
    count: int
    parts: int = 1

    def of(self, full: torch.Tensor) -> torch.Tensor:
        """This shard of `full` (a view when it is one block)."""
        blocks = [block.chunk(self.count, self.dim)[self.index] for block in full.chunk(self.parts, self.dim)]
        return blocks[0] if len(blocks) == 1 else torch.cat(blocks, self.dim)

    def ranges(self, shape: Sequence[int]) -> list[tuple[slice, ...]]:
        """The index ranges of this shard in a tensor of `shape`, one per packed block."""
        block = shape[self.dim] // self.parts
        width = block // self.count
        lead = (slice(None),) * self.dim
        return [
            lead + (slice(b * block + self.index * width, b * block + (self.index + 1) * width),)
            for b in range(self.parts)
        ]


class WeightFiles:
    """A model's safetensors files, by tensor name: whole tensors or shards read from disk
    without loading the rest."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        self.files: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self._handles: dict[Path, Any] = {}
        """Each file opened once (memory-mapped), for every tensor read from it."""
        for path in sorted(Path(directory).glob("*.safetensors")):
            handle = self._handles[path] = safe_open(str(path), framework="pt")
            for key in handle.keys():
                self.files[key] = path
                self.shapes[key] = tuple(handle.get_slice(key).get_shape())

    def read(self, name: str, cut: Cut | None, dtype: torch.dtype) -> torch.Tensor:
        piece = self._handles[self.files[name]].get_slice(name)
        if cut is None:
            value = piece[:]
        else:
            blocks = [piece[ranges] for ranges in cut.ranges(self.shapes[name])]
            value = blocks[0] if len(blocks) == 1 else torch.cat(blocks, cut.dim)
        return value.to(dtype)


class LoadedWeights:
    """Weights already loaded whole (files whose names the model's do not match, read by the
    library's own loader): the same interface as `WeightFiles`."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors
        self.files = tensors
        self.shapes = {name: tuple(t.shape) for name, t in tensors.items()}

    def read(self, name: str, cut: Cut | None, dtype: torch.dtype) -> torch.Tensor:
        full = self.tensors[name]
        return (cut.of(full) if cut is not None else full).to(dtype).clone()


class Skeleton:
    """A model's stages on the meta device and where their values come from (see the module
    docstring). `initialise(module)` sets one module's own tensors (the library's per-module
    rule); `names` are each stage's parameter names in the whole model; `weights`, when given,
    supply every parameter they name, at the right shape."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        initialise: Callable[[nn.Module], None],
        seed: int,
        names: Sequence[dict[str, str]],
        weights: WeightFiles | LoadedWeights | None = None,
    ) -> None:
        self.stages = list(stages)
        self._initialise, self._seed, self._weights = initialise, seed, weights
        self._twin_of = _twins(self.stages)
        """By module id, the uncut model's module that units are initialised in (the stages
        themselves get cut)."""
        self._units: list[tuple[str, nn.Module, bool, list[torch.Tensor]]] = []
        """(seed key, module, whether its submodules belong to it, its tensors as built — the
        module itself may hold shards of them by the time they are asked for)."""
        self._unit_of: dict[int, int] = {}
        self._name_of: dict[int, str] = {}
        for index, stage in enumerate(self.stages):
            for name, parameter in stage.named_parameters():
                if self._name_of.setdefault(id(parameter), names[index][name]) != names[index][name]:
                    continue
                shape = weights.shapes.get(names[index][name]) if weights is not None else None
                if shape is not None and shape != tuple(parameter.shape):
                    raise ConfigError(
                        f"the weight files hold {names[index][name]} as {list(shape)}; "
                        f"the model expects {list(parameter.shape)}"
                    )
            for label, unit, recurse in _units_of(stage):
                tensors = _own_tensors(unit, recurse)
                fresh = [t for t in tensors if id(t) not in self._unit_of]
                if not fresh:
                    continue
                first = next((self._name_of[id(t)] for t in tensors if id(t) in self._name_of), label)
                for tensor in fresh:
                    self._unit_of[id(tensor)] = len(self._units)
                self._units.append((first, unit, recurse, tensors))

    def whole(self, where: torch.device | str = "cpu") -> list[nn.Module]:
        """Every stage, real: what one process trains."""
        materialise(self, self.stages, {}, torch.device(where))
        return self.stages

    def values(self, wanted: Sequence[tuple[torch.Tensor, Cut | None]]) -> Iterator[tuple[int, torch.Tensor]]:
        """(position in `wanted`, real value on the host) of each (skeleton tensor, cut), as they
        are made: read from the weights, or a unit's initialisation run once for all the tensors
        asked of it — so the host holds one unit's full tensors at a time, not the rank's part."""
        by_unit: dict[int, list[int]] = {}
        for index, (tensor, cut) in enumerate(wanted):
            name = self._name_of.get(id(tensor))
            if self._weights is not None and name is not None and name in self._weights.files:
                yield index, self._weights.read(name, cut, tensor.dtype)
            else:
                by_unit.setdefault(self._unit_of[id(tensor)], []).append(index)
        for unit, indices in by_unit.items():
            initial = self._initialised(unit)
            for index in indices:
                tensor, cut = wanted[index]
                full = initial[id(tensor)]
                yield index, (cut.of(full) if cut is not None else full).clone()
            del initial

    def _initialised(self, unit: int) -> dict[int, torch.Tensor]:
        """Unit `unit`'s tensors (by the skeleton tensor's id) after its initialisation."""
        key, module, recurse, tensors = self._units[unit]
        twin = self._twin_of[id(module)]
        members = _post_order(twin) if recurse else [twin]
        real: dict[int, torch.Tensor] = {}
        saved: list[tuple[dict, str, torch.Tensor]] = []
        for sub in members:
            stores: tuple[dict, dict] = (sub._parameters, sub._buffers)
            for store in stores:
                for slot, tensor in store.items():
                    if tensor is None:
                        continue
                    made = real.get(id(tensor))
                    if made is None:
                        made = torch.empty_like(tensor, device="cpu")
                        if isinstance(tensor, nn.Parameter):
                            made = nn.Parameter(made, requires_grad=tensor.requires_grad)
                        real[id(tensor)] = made
                    saved.append((store, slot, tensor))
                    store[slot] = made
        try:
            digest = hashlib.sha256(f"{self._seed}:{key}".encode()).digest()
            # the host's generator only (what initialises these host tensors): torch.manual_seed
            # would also reseed every accelerator's, which fork_rng(devices=[]) does not restore
            with torch.random.fork_rng(devices=[]), torch.no_grad():
                torch.random.default_generator.manual_seed(int.from_bytes(digest[:8], "little"))
                for sub in members:
                    self._initialise(sub)
            values = {id(original): real[id(original)].detach() for original in tensors}
        finally:
            for store, slot, tensor in saved:
                store[slot] = tensor
        return values


def materialise(
    skeleton: Skeleton,
    modules: Iterable[nn.Module],
    cuts: dict[int, tuple[torch.Tensor, Cut]],
    where: torch.device,
) -> None:
    """Give every meta parameter and buffer of `modules` its real value on `where`, in place.
    `cuts`: a shard made on the meta device (by id) → (the skeleton tensor it was cut from, how)."""
    held: list[torch.Tensor] = []
    seen: set[int] = set()
    for module in modules:
        for tensor in _own_tensors(module, recurse=True):
            if tensor.is_meta and id(tensor) not in seen:
                seen.add(id(tensor))
                held.append(tensor)
    origins = [cuts.get(id(t), (t, None)) for t in held]
    for index, value in skeleton.values(origins):
        tensor, value = held[index], value.to(where)
        if isinstance(tensor, nn.Parameter):
            value = nn.Parameter(value, requires_grad=tensor.requires_grad)
        torch.utils.swap_tensors(tensor, value)


def _twins(stages: Sequence[nn.Module]) -> dict[int, nn.Module]:
    """Each module of `stages` (by id) copied as a structure: its own tables of parameters,
    buffers and submodules, holding the same tensors, every other attribute shared. A unit
    initialises in its twins, real tensors swapped into their tables, while cuts change the
    stages' own tables. A deepcopy also made new meta tensors and copied every attribute's
    contents: half the cost of building a small model's skeleton, for nothing initialisation reads."""
    twin_of: dict[int, nn.Module] = {}

    def twin(module: nn.Module) -> nn.Module:
        made = twin_of.get(id(module))
        if made is None:
            made = object.__new__(type(module))
            made.__dict__.update(module.__dict__)
            made.__dict__["_parameters"] = dict(module._parameters)
            made.__dict__["_buffers"] = dict(module._buffers)
            twin_of[id(module)] = made  # before the children: a module reached twice is one twin
            made.__dict__["_modules"] = {
                name: None if child is None else twin(child) for name, child in module._modules.items()
            }
        return made

    for stage in stages:
        twin(stage)
    return twin_of


def _units_of(stage: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """A stage's units of initialisation: its children, a ModuleList's elements each, and the
    stage's own tensors (label, module, whether its submodules belong to the unit)."""
    units: list[tuple[str, nn.Module, bool]] = []
    for name, child in stage.named_children():
        if isinstance(child, nn.ModuleList):
            units.extend((f"{name}.{i}", element, True) for i, element in enumerate(child))
        else:
            units.append((name, child, True))
    if _own_tensors(stage, recurse=False):
        units.append((type(stage).__name__, stage, False))
    return units


def _own_tensors(module: nn.Module, recurse: bool) -> list[torch.Tensor]:
    """The parameters and buffers of `module` (and, with `recurse`, of its submodules), each
    object once."""
    seen: set[int] = set()
    out = []
    for sub in module.modules() if recurse else (module,):
        for store in (sub._parameters, sub._buffers):
            for tensor in store.values():
                if tensor is not None and id(tensor) not in seen:
                    seen.add(id(tensor))
                    out.append(tensor)
    return out


def _post_order(module: nn.Module) -> list[nn.Module]:
    out = []
    for child in module.children():
        out.extend(_post_order(child))
    out.append(module)
    return out
