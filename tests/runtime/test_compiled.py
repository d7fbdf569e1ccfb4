"""Compiled stages (`--compile`): the same losses, gradients and weights as eager for schedules
with and without a split backward (fp32 on CPU's inductor: rtol 1e-5), the W GEMMs deferred
through compilation, and a W that follows its B at once folded into the B.

Compiling is slow on a CPU: inductor builds C++ kernels, and a fresh checkout (CI's) has none in
its cache — the two-stage run took 29–40 s cold against 4 warm. So the whole stages compile
through dynamo and AOTAutograd with the `aot_eager` backend (what a split backward must survive:
graph capture, the deferred-linear custom op in the joint graph, the W queued from the compiled
backward), and what inductor itself does to them — its fused kernels' numbers, its reuse of
buffers the queued W still needs, the loss's saved tensors — is checked on one block and on the
loss, compiled by inductor."""

import functools

import pytest

torch = pytest.importorskip("torch")

from helpers.runtime import TINY_LLAMA  # noqa: E402

from pipeloom import build_schedule  # noqa: E402
from pipeloom.models.llama import LlamaConfig  # noqa: E402
from pipeloom.passes.split_backward import w_at_once_keys  # noqa: E402
from pipeloom.runtime.in_process import run_in_process  # noqa: E402
from pipeloom.runtime.split_linear import SplitLinear, WeightGradQueue  # noqa: E402
from pipeloom.runtime.training import TrainSpec  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def vector_instructions_from_the_cpu_flags():
    """Inductor takes the vector instructions the CPU's flags name (TORCHINDUCTOR_VEC_ISA_OK)
    instead of compiling a test program for each: 7.6 s of a cold cache here, for nothing these
    tests check."""
    import torch._inductor.config

    with torch._inductor.config.patch({"cpp.vec_isa_ok": True}):
        yield


def _assert_same_training(eager, compiled, what: str, lr: float, steps: int) -> None:
    """Inductor sums in its own order: ulps apart in the gradients, which AdamW's normalised
    update turns into up to lr × 1e-3 of a weight a step where a gradient is near zero."""
    assert compiled[0].losses == pytest.approx(eager[0].losses, rel=1e-5)
    for a, b in zip(eager, compiled, strict=True):
        for kept, atol in (("gradients", 1e-6), ("parameters", lr * steps * 1e-3)):
            for stage, tensors in getattr(a, kept).items():
                for name, value in tensors.items():
                    got = getattr(b, kept)[stage][name]
                    torch.testing.assert_close(
                        got, value, rtol=1e-5, atol=atol, msg=lambda m, name=name: f"{what} {name}: {m}"
                    )


def test_compiled_stages_train_as_eager_with_and_without_a_split_backward(monkeypatch):
    """zb-h1 on two devices runs both paths: the first device's every W follows its own B at
    once and folds into it (plain linears, autograd's weight gradients), the last device's wait
    (the deferred-linear custom op, W queued and run apart)."""
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="aot_eager"))
    schedule = build_schedule("zb-h1", 2, 4)
    assert [len(w_at_once_keys(schedule.devices[d], False)) for d in range(2)] == [4, 0]
    config = LlamaConfig(layers=2, **TINY_LLAMA)
    fields = dict(config=config, steps=2, record_gradients=True, lr=1e-2)
    eager = run_in_process(TrainSpec(schedule, **fields))
    compiled = run_in_process(TrainSpec(schedule, **fields, compile=True))
    _assert_same_training(eager, compiled, "zb-h1", fields["lr"], fields["steps"])


class _Block(torch.nn.Module):
    """Two split linears with pointwise work around them: inductor reuses the buffers of the
    intermediates once their last use in the graph has passed."""

    def __init__(self, queue: WeightGradQueue) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = SplitLinear(torch.nn.Linear(8, 16), queue)
        self.mid = SplitLinear(torch.nn.Linear(16, 16, bias=False), queue)
        self.down = SplitLinear(torch.nn.Linear(16, 16, bias=False), queue)

    def forward(self, x):
        h = torch.tanh(self.up(x))
        h = torch.sin(self.mid(h)) * 0.5
        return torch.cos(self.down(h)) * h


@pytest.mark.parametrize("input_grad", [True, False])
def test_compiled_split_linears_queue_their_weight_gradients_for_w(input_grad):
    """Queued under the backward's key, whether or not the stage's input wants a gradient (the
    compiler would drop a backward op whose result nobody reads), and the queued tensors are
    still the right ones when W runs after the graph has reused its buffers."""
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_(input_grad)
    results = []
    for compiled in (False, True):
        queue = WeightGradQueue()
        block = _Block(queue)
        if compiled:
            block.compile()
        queue.backward_key = (0, 0, 0)
        block(x).sum().backward()
        queue.backward_key = None
        assert len(queue) == 3 and all(t.grad is None for t in block.parameters())
        queue.run((0, 0, 0))
        results.append([t.grad.clone() for t in block.parameters()])
    for eager, compiled in zip(*results, strict=True):  # sums of 4 rows of products of order 1,
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)  # inductor's sin/tanh ulps apart


def test_a_split_linear_backward_outside_a_b_is_refused():
    queue = WeightGradQueue()
    block = _Block(queue)
    with pytest.raises(RuntimeError, match="outside an executor's B"):
        block(torch.randn(2, 8)).sum().backward()


def test_a_w_with_nothing_to_fill_folds_into_its_b():
    zb_h1 = build_schedule("zb-h1", 2, 4)
    # device 0 runs each W right after its B; device 1 defers them behind the next forwards
    assert w_at_once_keys(zb_h1.devices[0], alone=False) == {(0, mb, 0) for mb in range(4)}
    assert w_at_once_keys(zb_h1.devices[1], alone=False) == set()
    # one device alone: no other device waits for a B, so every whole W folds
    zb_v = build_schedule("zb-v", 1, 4)
    assert w_at_once_keys(zb_v.devices[0], alone=True) == {(s, mb, 0) for s in (0, 1) for mb in range(4)}
    assert w_at_once_keys(zb_v.devices[0], alone=False) == set()


def test_the_compiled_loss_keeps_no_fp32_logits_for_its_backward():
    """Eager cross-entropy over bf16 logits upcasts them and saves two fp32 copies for its backward
    (the upcast and the log-softmax); the compiled loss saves the bf16 logits and a number a row."""
    from pipeloom.models.workload import token_loss
    from pipeloom.runtime.compiled import compile_stages

    logits = torch.randn(2, 64, 512, dtype=torch.bfloat16, requires_grad=True)
    targets = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    saved_bytes = []
    for loss in (token_loss, compile_stages({}, {}, token_loss)):
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(t) or t, lambda t: t):
            value = loss(logits, targets)
        value.backward()
        saved_bytes.append(sum(t.numel() * t.element_size() for t in saved))
    fp32_logits = logits.numel() * 4
    assert saved_bytes[0] >= 2 * fp32_logits
    assert saved_bytes[1] < logits.numel() * 2 + fp32_logits // 8  # the bf16 logits, a few numbers a row
