"""Context parallelism inside a stage: each of cp ranks holds 1/cp of every sequence.

The sequence is cut into 2·cp chunks and rank i holds chunks i and 2·cp − 1 − i (torchtitan's
head-tail load balancer, Megatron's): under a causal mask the early chunks attend to few keys and
the late ones to many, so each rank's pair does the same attention work. Every token-wise part of
a layer (norms, projections, MLP, rotary embeddings at the tokens' true positions, the loss) runs
on the rank's own tokens; attention needs every key and value of the sequence, so each layer
all-gathers them over the group and masks causally by true position — query at position p sees
the keys at positions ≤ p, wherever they came from.

Why an all-gather of K and V (as Llama 3 trained with context parallelism) and not torch's
`context_parallel` (ring attention): torch's ring runs only on the CUDA SDPA kernels (flash,
efficient, cuDNN), not on CPU ranks over gloo, where this runtime proves its numbers; the
all-gather is one DTensor redistribution — Shard(sequence) to Replicate, its backward a
reduce-scatter of the keys' and values' gradients (each rank's queries' share, summed) — that
runs on any backend, and with GQA's few K/V heads it moves little. It runs in the layer's F and
B; the weight gradients (W) stay local, so the B/W split is unchanged.

The gather hooks into transformers' own attention through its cache slot: a layer hands its
keys and values to `past_key_values.update` and attends to what comes back, so `KeyValueGather`
returns the whole sequence's, and the stage passes the causal mask over true positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

__all__ = ["ContextShard", "KeyValueGather", "head_tail_positions"]

_SEQUENCE = 1  # (batch, sequence, ...): what the data and the hidden states are cut along
_KV_SEQUENCE = 2  # (batch, heads, sequence, head dim): transformers' keys and values


def head_tail_positions(seq_len: int, cp: int, index: int) -> torch.Tensor:
    """The positions rank `index` of `cp` holds: chunks index and 2·cp − 1 − index of 2·cp."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not cut into {2 * cp} equal chunks")
    chunk = seq_len // (2 * cp)
    head, tail = index * chunk, (2 * cp - 1 - index) * chunk
    return torch.cat([torch.arange(head, head + chunk), torch.arange(tail, tail + chunk)])


@dataclass
class ContextShard:
    """This rank's share of every sequence, and its context-parallel group (None: one rank)."""

    size: int
    index: int
    seq_len: int
    mesh: DeviceMesh | None = None
    sent_bytes: int = 0
    """Bytes this rank sent in the K/V all-gathers since the step began, as a ring moves them
    ((cp − 1) times its own keys and values), the backward's reduce-scatters included when
    autograd will run them."""
    _made: dict = field(default_factory=dict, repr=False)
    """(what, device) → its tensor, made once: every op of every step reads the same positions."""

    def positions(self, device: torch.device | None = None) -> torch.Tensor:
        return self._once("positions", device, lambda: head_tail_positions(self.seq_len, self.size, self.index))

    def every_position(self, device: torch.device | None = None) -> torch.Tensor:
        """The positions of the gathered keys, in the group's order (rank 0's, then rank 1's...)."""
        return self._once(
            "every",
            device,
            lambda: torch.cat([head_tail_positions(self.seq_len, self.size, i) for i in range(self.size)]),
        )

    def _once(self, what: str, device: torch.device | None, make) -> torch.Tensor:
        key = (what, str(device))
        if key not in self._made:
            self._made[key] = make().to(device)
        return self._made[key]

    def cut(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of a (batch, sequence, ...) tensor of whole sequences."""
        if tensor.dim() < 2 or tensor.shape[_SEQUENCE] != self.seq_len:
            return tensor
        return tensor.index_select(_SEQUENCE, self.positions(tensor.device))

    def causal_mask(self, device: torch.device) -> torch.Tensor:
        """(1, 1, own tokens, every token): whether a query may see a key, by true positions."""

        def make() -> torch.Tensor:
            own, every = self.positions(), self.every_position()
            return (every[None, :] <= own[:, None])[None, None]

        return self._once("mask", device, make)

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's keys (or values) along their sequence dimension; backward: each rank's
        gradients of its own, summed over the group's queries (a reduce-scatter)."""
        if self.mesh is None or self.size == 1:
            return tensor
        placed = DTensor.from_local(tensor, self.mesh, [Shard(_KV_SEQUENCE)], run_check=False)
        gathered = placed.redistribute(self.mesh, [Replicate()]).to_local(grad_placements=[Partial()])
        sent = (self.size - 1) * tensor.numel() * tensor.element_size()
        self.sent_bytes += sent * (2 if torch.is_grad_enabled() and tensor.requires_grad else 1)
        return gathered


class KeyValueGather:
    """What a transformers attention layer takes for its cache: handed a layer's keys and values
    for this rank's tokens, it returns the whole sequence's (`ContextShard.gather`)."""

    def __init__(self, shard: ContextShard) -> None:
        self.shard = shard

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.shard.gather(keys), self.shard.gather(values)
