"""Backward split into B and W for linear layers (Zero Bubble §2, 2BP §3), with autograd.

A `SplitLinear` computes only the input gradient in its backward and hands the weight-gradient
GEMM — its input and the output gradient — to a `WeightGradQueue` under the key of the backward
that runs it (`backward_key`, set by the executor's B: whichever thread autograd runs the
backward on). The executor's W op then runs the queued GEMMs of its key. Other parameters
(norms, embeddings) get their gradients during B as usual. Each executor owns its queue.

Compiled (`torch.compile`), the split linear is a custom op with its own autograd
(`pipeloom::deferred_linear`), so a stage stays one graph and the deferred GEMMs survive
compilation: its backward computes the input gradient and calls `pipeloom::defer_weight_grad`,
an op marked as having a side effect so the compiler keeps it even where no input gradient is
wanted. That op copies the two tensors it queues, because inductor reuses the buffers of a
graph's intermediates (the output gradient, an input it chose to recompute) once their last use
in the graph has passed — and a queued tensor is used later, by W. The alternative, a graph break
at every linear (compiled regions between eager linears), costs a guard check and a return to
Python per linear, seven per decoder layer, and loses every fusion across them. A queue that is
not `deferring` (a micro-batch whose W follows its B at once: nothing to fill) leaves its linears
ordinary, so their weight gradients come out of the backward as they would without a split.
"""

from __future__ import annotations

import weakref
from collections import defaultdict
from typing import cast

import torch
from torch import nn

from pipeloom.runtime.gradients import grad_of

__all__ = ["WeightGradQueue", "SplitLinear", "split_linears"]


class WeightGradQueue:
    """Pending weight-gradient GEMMs, by op key."""

    def __init__(self) -> None:
        self.backward_key: tuple | None = None
        """The key of the backward running now: what its linears' GEMMs wait under."""
        self.deferring = True
        """Whether the forward running now defers its weight gradients (False: the linears are
        ordinary, for a micro-batch whose W would follow its B at once)."""
        self._pending: dict[tuple, list[tuple[nn.Module, torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._split: dict[tuple, list] = {}  # a key whose W runs in parts: all its GEMMs
        self._parts_done: dict[tuple, set[int]] = {}

    def push(self, layer: nn.Module, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        key = self.backward_key
        if key is None:
            raise RuntimeError("a split linear's backward ran outside an executor's B: its weight gradient has no W")
        self._pending[key].append((layer, inputs, grad_output))

    def run(self, *keys: tuple) -> None:
        """Accumulate the weight gradients of `keys`; several keys of one layer run as one GEMM
        over their concatenated rows (2BP's concatenation)."""
        by_layer: dict[int, list] = {}
        for key in keys:
            for layer, inputs, grad_output in self._pending.pop(key, ()):
                by_layer.setdefault(id(layer), [layer, [], []])
                by_layer[id(layer)][1].append(inputs.reshape(-1, inputs.shape[-1]))
                by_layer[id(layer)][2].append(grad_output.reshape(-1, grad_output.shape[-1]))
        for layer, inputs, grad_outputs in by_layer.values():
            x = inputs[0] if len(inputs) == 1 else torch.cat(inputs)
            gy = grad_outputs[0] if len(grad_outputs) == 1 else torch.cat(grad_outputs)
            a, b = (x.t(), gy) if layer.transposed else (gy.t(), x)
            _accumulate_product(layer.weight, a, b)
            if layer.bias is not None and layer.add_bias:
                _accumulate(layer.bias, gy.sum(0))

    def run_part(self, key: tuple, part: int, parts: int) -> None:
        """Part `part` of `parts` of `key`'s GEMMs (MEPipe's fine-grained W): the queued GEMMs in
        B's order, cut into `parts` runs as even as possible; the last part clears the key."""
        entries = self._split.setdefault(key, self._pending.pop(key, []))
        share = entries[part * len(entries) // parts : (part + 1) * len(entries) // parts]
        if share:
            self._pending[key] = share
            self.run(key)
        done = self._parts_done.setdefault(key, set())
        done.add(part)
        if len(done) == parts:
            del self._split[key], self._parts_done[key]

    def run_ops(self, ops, index: int, concat: bool) -> int:
        """Run the W op `ops[index]` — its share, for a W in parts; with `concat`, together with
        the W of its stage right after it, as one GEMM (2BP) — and return how many ops it took."""
        op = ops[index]
        if op.parts > 1:
            self.run_part(op.key, op.part, op.parts)
            return 1
        run = [op]
        for following in ops[index + 1 :] if concat else ():
            if following.kind is not op.kind or following.stage != op.stage or following.parts > 1:
                break
            run.append(following)
        self.run(*(o.key for o in run))
        return len(run)

    def held_bytes(self, key: tuple) -> int:
        """Bytes `key`'s queued GEMMs hold until its W — their inputs and output gradients, each
        tensor once (q, k and v share an input)."""
        seen: set[int] = set()
        total = 0
        for _, inputs, grad_output in self._pending.get(key, ()):
            for tensor in (inputs, grad_output):
                if tensor.data_ptr() not in seen:
                    seen.add(tensor.data_ptr())
                    total += tensor.numel() * tensor.element_size()
        return total

    def __len__(self) -> int:
        pending = sum(len(entries) for entries in self._pending.values())
        return pending + sum(len(entries) for entries in self._split.values())


_WIDE_ADDMM = "dtype_out" in torch.ops.aten.addmm.overloads()
"""Whether this torch has addmm with a wider output type (bf16 × bf16 accumulated into fp32)."""


def _accumulate_product(parameter: nn.Parameter, a: torch.Tensor, b: torch.Tensor) -> None:
    """parameter.grad += a @ b, in place when the types agree; under mixed precision the product
    runs in the compute type and accumulates into the fp32 gradient (`.grad` of fp32 weights, or
    the `main_grad` of weights kept in the compute type) — in one GEMM where the device has
    one with a wider output (`out_dtype`, CUDA), else as a product, a cast and an add."""
    grad = grad_of(parameter)
    if grad is not None and a.dtype == grad.dtype:
        grad.addmm_(a, b)
    elif _WIDE_ADDMM and grad is not None and grad.is_cuda and grad.dtype == torch.float32 and grad.is_contiguous():
        torch.addmm(grad, a, b, out_dtype=torch.float32, out=grad)
    else:
        _accumulate(parameter, a @ b)


def _accumulate(parameter: nn.Parameter, grad: torch.Tensor) -> None:
    main = getattr(parameter, "main_grad", None)
    if main is not None:
        main.add_(grad.to(main.dtype))
        return
    grad = grad.to(parameter.dtype)
    if parameter.grad is None:
        parameter.grad = grad
    else:
        parameter.grad.add_(grad)


class _InputGradOnly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, layer, queue):  # noqa: D401 - autograd signature
        ctx.save_for_backward(x, weight)
        ctx.layer, ctx.queue = layer, queue
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        ctx.queue.push(ctx.layer, x.detach(), grad_output.detach())
        grad_input = grad_output @ weight.to(grad_output.dtype) if ctx.needs_input_grad[0] else None
        return grad_input, None, None, None, None


# The compiled split linear. A custom op takes tensors and numbers only, so a layer travels as its
# weight (`owner`: the parameter, before any cast) and is found again by where that weight lives:
# graphs stay free of per-layer constants, and stages of one shape share one compiled graph.
_DEFERRING: weakref.WeakSet[SplitLinear] = weakref.WeakSet()
_by_address: dict[int, weakref.ref[SplitLinear]] = {}


def _layer_of(owner: torch.Tensor) -> SplitLinear:
    found = _by_address.get(owner.data_ptr())
    layer = found() if found is not None else None
    if layer is None or layer.weight.data_ptr() != owner.data_ptr():  # weights placed or moved since
        _by_address.clear()
        _by_address.update((layer.weight.data_ptr(), weakref.ref(layer)) for layer in _DEFERRING)
        layer = _by_address[owner.data_ptr()]()
    assert layer is not None and layer.queue is not None
    return layer


@torch.library.custom_op("pipeloom::deferred_linear", mutates_args=())
def _deferred_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, owner: torch.Tensor
) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)


@_deferred_linear.register_fake
def _(x, weight, bias, owner):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.custom_op("pipeloom::defer_weight_grad", mutates_args=())
def _defer_weight_grad(x: torch.Tensor, grad_output: torch.Tensor, owner: torch.Tensor) -> None:
    layer = _layer_of(owner)
    assert layer.queue is not None
    layer.queue.push(layer, x.detach().clone(), grad_output.detach().clone())  # copies: see the module's note


@_defer_weight_grad.register_fake
def _(x, grad_output, owner):
    return None


torch.fx.node.has_side_effect(torch.ops.pipeloom.defer_weight_grad.default)


def _save_deferred(ctx, inputs, output) -> None:
    x, weight, _, owner = inputs
    ctx.save_for_backward(x, weight, owner)


def _deferred_backward(ctx, grad_output):
    x, weight, owner = ctx.saved_tensors
    torch.ops.pipeloom.defer_weight_grad(x, grad_output, owner)
    grad_input = grad_output @ weight if ctx.needs_input_grad[0] else None
    return grad_input, None, None, None


_deferred_linear.register_autograd(_deferred_backward, setup_context=_save_deferred)


class SplitLinear(nn.Module):
    """An nn.Linear (or a Hugging Face Conv1D, whose weight is stored transposed) whose weight
    gradient waits in `queue` for the W op; without a queue an ordinary linear (tensor
    parallelism cuts every linear of a stage through this one class)."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, linear: nn.Module, queue: WeightGradQueue | None, transposed: bool = False) -> None:
        super().__init__()
        self.weight = cast(torch.Tensor, linear.weight)
        self.bias = cast(torch.Tensor | None, linear.bias)
        self.queue = queue
        self.transposed = transposed
        self.add_bias = True
        """False for a row-parallel linear: its bias is added once, after the partial sums are
        reduced (`tensor_parallel.Rowwise`)."""
        if queue is not None:
            _DEFERRING.add(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.t() if self.transposed else self.weight
        bias = self.bias if self.add_bias else None
        if torch.is_autocast_enabled(x.device.type):  # the product in the compute type, as autocast would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = bias.to(dtype) if bias is not None else None
        if self.queue is None or not self.queue.deferring or not torch.is_grad_enabled():
            return nn.functional.linear(x, weight, bias)
        if torch.compiler.is_compiling():
            return _deferred_linear(x, weight, bias, self.weight)
        return _InputGradOnly.apply(x, weight, bias, self, self.queue)


def _is_conv1d(module: nn.Module) -> bool:
    """transformers' Conv1D (GPT-2): a linear layer with its weight as (in, out)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight")


def split_linears(module: nn.Module, queue: WeightGradQueue | None) -> int:
    """Replace every nn.Linear (and transformers Conv1D) inside `module` by a SplitLinear on
    `queue` (None: computing its weight gradient in the backward as usual); return how many."""
    count = 0
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, SplitLinear(child, queue))
            count += 1
        elif _is_conv1d(child):
            setattr(module, name, SplitLinear(child, queue, transposed=True))
            count += 1
        else:
            count += split_linears(child, queue)
    return count
