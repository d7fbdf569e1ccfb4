"""What a mixture-of-experts model from transformers (Mixtral, Qwen2-MoE, Qwen3-MoE) adds to a
dense one: where its routed experts are (for expert parallelism) and its load-balancing loss.

The auxiliary loss is the library's `load_balancing_loss_func`, which needs every layer's router
logits of a micro-batch at once — and the layers are spread over the pipeline. So, when the
config asks for it (`output_router_logits`), each stage captures its routers' logits and hands
them on, concatenated with what it received, beside the hidden states; the last stage's loss is
the token loss plus `router_aux_loss_coef` × the library's function of them all. The logits carry
their gradients back through the boundaries like the hidden states do. The function reduces
over rows, so one tensor of all layers' rows gives what a tuple of per-layer ones gives.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from pipeloom.errors import ConfigError

__all__ = ["RouterLogits", "expert_plan", "num_experts", "router_loss"]


def num_experts(config) -> int:
    return int(getattr(config, "num_local_experts", None) or config.num_experts)


def expert_plan(config):
    from pipeloom.models.workload import ExpertPlan

    experts, top_k = num_experts(config), getattr(config, "num_experts_per_tok", 1)
    if not 1 <= top_k <= experts:  # the router's top-k would fail deep in the first forward
        raise ConfigError(
            f"hf: the config routes each token to {top_k} experts (num_experts_per_tok) but the model has "
            f"{experts}; it must be between 1 and {experts}"
        )
    return ExpertPlan(experts, "layers.*.mlp.experts")


def router_loss(config, base: Callable) -> Callable:
    """The library's loss of a MoE causal LM: `base` on the logits, plus the load-balancing loss
    when the config computes it (the last stage then receives the router logits as well)."""
    if not getattr(config, "output_router_logits", False):
        return base
    import importlib

    family = config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    experts, top_k, coef = num_experts(config), config.num_experts_per_tok, config.router_aux_loss_coef

    def loss(output, targets):
        logits, routers = output
        aux = module.load_balancing_loss_func((routers.float(),), experts, top_k)
        token_loss = base(logits, targets)
        local = getattr(token_loss, "to_local", None)  # over vocabulary-sharded logits: a replicated DTensor
        return (local() if local is not None else token_loss) + coef * aux

    return loss


class RouterLogits:
    """Captures the router logits of a stage's MoE layers (a forward hook on each router)."""

    def __init__(self, config, layers: Sequence[nn.Module]) -> None:
        self.experts = num_experts(config)
        self._captured: list[torch.Tensor] = []
        for layer in layers:
            router = getattr(getattr(layer, "mlp", None), "gate", None)
            if router is not None and hasattr(router, "top_k"):
                router.register_forward_hook(lambda _m, _a, out: self._captured.append(out[0]))

    def begin(self) -> None:
        self._captured = []

    def handed_on(self, hidden: torch.Tensor, carried: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden states, every router's logits so far: the received ones, then this stage's)."""
        if len(carried) > 1:
            raise ConfigError(f"hf: a stage received {len(carried)} tensors beside the hidden states; expected 1")
        parts, self._captured = [*carried, *self._captured], []  # handed on: no longer this stage's to keep
        if not parts:
            return hidden, hidden.new_zeros((0, self.experts))
        return hidden, torch.cat([p.to(parts[-1].dtype) for p in parts])
