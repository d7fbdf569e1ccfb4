"""What crosses each stage boundary — shapes and dtypes, inferred from one example micro-batch.

A stage may take and return a tensor or a tuple of tensors, and boundaries may differ in shape
(a ResNet's feature maps shrink, a model may hand a mask along with its hidden states). Rather
than asking the user to spell them out, the runtime runs one example micro-batch through the
stages once — on fake tensors, in eval mode (so batch-norm statistics do not move) — and records
what each stage hands to the next, and the bytes autograd saves for each stage's backward (the
activations a micro-batch leaves stashed, for the memory guard before a run). Receive buffers are then allocated from these specs;
gradients travel for the floating tensors only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["TensorSpec", "StageProbe", "as_tuple", "probe_stages"]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device) -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)

    @property
    def floating(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def nbytes(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count * torch.empty((), dtype=self.dtype).element_size()


def as_tuple(value: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    return (value,) if isinstance(value, torch.Tensor) else tuple(value)


@dataclass(frozen=True)
class StageProbe:
    boundaries: list[tuple[TensorSpec, ...]]
    """Per stage s, the specs of its input (index 0: the data)."""
    forward_flops: list[float]
    """Per stage, the FLOPs of one micro-batch's forward (matrix products, convolutions,
    attention, as torch's FlopCounterMode counts them); training costs three times that."""
    stash_bytes: list[float] = field(default_factory=list)
    """Per stage, the bytes autograd saves for one micro-batch's backward (parameters and their
    casts left out): what a forward leaves on the device until its backward."""


def probe_stages(
    stages: Sequence[nn.Module],
    example: tuple[torch.Tensor, ...],
    run: Callable[[nn.Module, tuple[torch.Tensor, ...]], tuple[torch.Tensor, ...]],
    rebuild: Callable[[], Sequence[nn.Module]] | None = None,
) -> StageProbe:
    """Run one example micro-batch through every stage. `run(stage, inputs)` is how the executor
    calls a stage (slices, precision), returning its outputs as handed on. The pass runs on fake
    tensors (shapes and dtypes only), so it costs nothing even for a model far larger than this
    host's CPU could run; a small model (`_cheap`), or one whose control flow reads tensor
    values, is run for real. Stages on the meta device (`pipeloom.models.materialise`) run with
    fake weights in place of their meta ones; a small model, or one where that fails (control
    flow on values: a mixture of experts' routing), runs on the real stages `rebuild()` gives."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = [module.training for stage in stages for module in stage.modules()]
    try:
        for stage in stages:
            stage.eval()
        if any(t.is_meta for stage in stages for t in stage.parameters()):
            if rebuild is not None and _cheap(stages, example):  # a small model: real is quicker
                return probe_stages(rebuild(), example, run)
            try:
                return _walk_meta(stages, example, run)
            except Exception:  # noqa: BLE001 - data-dependent control flow: real weights needed
                if rebuild is None:
                    raise
                return probe_stages(rebuild(), example, run)
        if _cheap(stages, example):
            return _walk(stages, example, run)
        try:
            with FakeTensorMode(allow_non_fake_inputs=True) as fake:
                return _walk(stages, tuple(fake.from_tensor(t) for t in example), run)
        except Exception:  # noqa: BLE001 - data-dependent control flow: fall back to a real pass
            return _walk(stages, example, run)
    finally:
        flags = iter(modes)
        for stage in stages:
            for module in stage.modules():
                module.training = next(flags)


def _walk_meta(stages, example, run) -> StageProbe:
    """`_walk` on fake tensors, every meta parameter and buffer standing in as a fake host one.
    It walks a copy: fake tensor conversion keeps weak references to the tensors it meets, and a
    tensor with one cannot later be swapped for its real value (`materialise`)."""
    import copy
    from contextlib import ExitStack

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.nn.utils.stateless import _reparametrize_module

    cpu = torch.device("cpu")
    stages = copy.deepcopy(list(stages))
    with FakeTensorMode(allow_non_fake_inputs=True) as fake, ExitStack() as stack:
        made: dict[int, torch.Tensor] = {}
        for stage in stages:
            named = [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]
            swapped = {}
            for name, tensor in named:
                if tensor.is_meta:
                    if id(tensor) not in made:
                        twin = fake.fake_tensor_converter.from_meta_and_device(fake, tensor, cpu)
                        made[id(tensor)] = twin.requires_grad_(tensor.requires_grad)
                    swapped[name] = made[id(tensor)]
            stack.enter_context(_reparametrize_module(stage, swapped))
        return _walk(stages, tuple(fake.from_tensor(t) for t in example), run)


_REAL_PASS_MACS = 1e8
"""Below this many multiply-adds (weights × example elements) a real pass takes milliseconds,
less than dispatching it through fake tensors."""


def _cheap(stages: Sequence[nn.Module], example: tuple[torch.Tensor, ...]) -> bool:
    weights = sum(t.numel() for stage in stages for t in stage.parameters())
    elements = sum(t.numel() for t in example)
    return weights * elements < _REAL_PASS_MACS


def _no_backward(_packed: None) -> torch.Tensor:
    raise RuntimeError("the boundary probe runs forwards only: it keeps no saved tensor for a backward")


def _walk(stages, example, run) -> StageProbe:
    from torch.utils.flop_counter import FlopCounterMode

    specs = [tuple(TensorSpec(tuple(t.shape), t.dtype) for t in example)]
    flops, stashes = [], []
    x = example
    for index, stage in enumerate(stages):
        counter = FlopCounterMode(display=False)
        weights = {tuple(p.shape) for p in stage.parameters()}
        saved: dict[int, tuple[torch.Tensor, int]] = {}

        def pack(tensor: torch.Tensor, weights=weights, saved=saved) -> None:
            # held here for the stage's pass (so no id is reused while counting), not in the graph:
            # a tensor packed as itself is held by its own grad_fn, a cycle through C++ that
            # Python's collector cannot see, and every probe's tensors leaked
            if tuple(tensor.shape) not in weights:  # a weight (or its autocast copy) is no activation
                saved[id(tensor)] = (tensor, tensor.numel() * tensor.element_size())

        with counter, torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _no_backward):
            out = run(stage, tuple(t.detach().requires_grad_(t.is_floating_point()) for t in x))
        flops.append(float(counter.get_total_flops()))
        stashes.append(float(sum(size for _, size in saved.values())))
        saved.clear()
        if index < len(stages) - 1:
            x = tuple(t.detach() for t in out)
            specs.append(tuple(TensorSpec(tuple(t.shape), t.dtype) for t in x))
    return StageProbe(specs, flops, stashes)
