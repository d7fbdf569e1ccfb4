"""Expert parallelism: each MoE layer's routed experts shared out over an EP group (DeepSeek-V3,
torchtitan's "dp2ep"), the group made of data-parallel replicas of one pipeline device.

EP rank j of a group of `ep` keeps experts j·E/ep .. (j+1)·E/ep − 1 of every MoE layer (a slice
of the library's stacked expert weights) and serves them to the tokens of all the group's
replicas. Around the library's experts module, two hooks (as torchtitan's) do the routing:

* before it — dispatch: the (token, choice) pairs the library's router picked are sorted by
  expert; the counts per expert cross first (so each rank knows what it will receive), then the
  token rows, with `all_to_all_single` over uneven splits — dropless, no capacity;
* the library's experts then run on the rows received: its weights and its gate, expert by
  expert, each expert's rows found by the counts the host read (`_RoutedExperts.experts`) — the
  one read of a layer's call, an uneven all-to-all's split sizes, taken with the counts sent;
* after it — combine: the rows return by the reverse all-to-all, are weighted by the router's
  top-k weights and summed into their tokens in expert order, as the library's dense loop sums.

Each all-to-all is an autograd Function whose backward is the reverse exchange. It is issued
asynchronously and passes the baton of an overlapped F&B pair (`pair_baton`) before waiting, so
the paired op computes while it is in flight. `ExpertTraffic` counts what a rank sent, how long
its exchanges were in flight, how much of that it waited for, and the tokens routed per expert:
on a GPU from CUDA events on the exchange's stream and the paired op's (`clocks`), read at the
step's end — host clocks there would read the time to issue an exchange, not its flight.

Why not DTensor here, as for tensor parallelism: token routing is an all-to-all with splits that
change every call, which DTensor's placements do not express; the expert weights are plain
local slices, like the tensor-parallel shards, and `full` gathers them for reports.
"""

from __future__ import annotations

import fnmatch
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from pipeloom.models.materialise import Cut
from pipeloom.runtime.clocks import Clock, HostClock
from pipeloom.runtime.pair_baton import Turn, pass_baton

__all__ = ["ExpertExchange", "ExpertTraffic", "expert_parameter_ids", "shard_experts"]


@dataclass
class ExpertTraffic:
    """One step's expert all-to-alls on this rank."""

    sent_bytes: int = 0
    """Bytes sent to the other ranks of the EP group (token rows, their gradients, counts)."""
    flight_s: float = 0.0
    """Seconds from issuing each exchange to its completion, summed."""
    exposed_s: float = 0.0
    """Of those, the seconds this rank waited (the rest ran under the paired op's compute)."""
    overlapped_flight_s: float = 0.0
    """The part of `flight_s` of exchanges that handed the baton to a paired op (what a pair
    could hide; the hidden time is all theirs)."""
    forward_flight_s: float = 0.0
    """The part of `flight_s` in forwards (dispatch, combine and the counts); the rest is in backwards."""
    tokens: list[int] = field(default_factory=list)
    """(token, choice) pairs this rank routed to each expert, forwards with autograd only — so a
    checkpointed micro-batch counts once, at its recompute."""
    flights: list[_Flight] = field(default_factory=list)
    """The step's exchanges as marked, until `settle` reads their times."""

    def reset(self, num_experts: int) -> None:
        self.sent_bytes, self.flight_s, self.exposed_s = 0, 0.0, 0.0
        self.overlapped_flight_s, self.forward_flight_s = 0.0, 0.0
        self.tokens = [0] * num_experts
        self.flights = []

    def settle(self, clock: Clock) -> None:
        """Read the step's exchange times off `clock` (on a GPU: once the device has passed them)."""
        for flight in self.flights:
            seconds = clock.seconds(flight.issued, flight.finished)
            self.flight_s += seconds
            if not flight.backward:
                self.forward_flight_s += seconds
            hidden = 0.0
            if flight.turn is not None:  # the partner ran from its turn's start to its end
                self.overlapped_flight_s += seconds
                began = max(0.0, clock.seconds(flight.issued, flight.turn.began))
                ended = min(seconds, clock.seconds(flight.issued, flight.turn.ended))
                hidden = max(0.0, ended - began)
            self.exposed_s += seconds - hidden
        self.flights = []


@dataclass(frozen=True)
class _Flight:
    """One exchange: when it was issued and finished, and the paired op's turn meanwhile."""

    issued: Any
    finished: Any
    turn: Turn | None
    backward: bool


class ExpertExchange:
    """This rank's EP group: `size` ranks, this one `index`, over `num_experts` experts a layer."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        size: int,
        index: int,
        num_experts: int,
        clock: Clock | None = None,
        mesh: DeviceMesh | None = None,
    ) -> None:
        self.group, self.size, self.index = group, size, index
        self.mesh = mesh
        """The group as a one-dimensional DeviceMesh: what a checkpoint's expert shards live on."""
        self.clock = clock or HostClock()
        self.num_experts, self.local = num_experts, num_experts // size
        self.traffic = ExpertTraffic(tokens=[0] * num_experts)
        self.sharded: set[int] = set()
        """Ids of the expert shards this rank holds."""
        self.cuts: dict[int, tuple[torch.Tensor, Cut]] = {}
        """During set-up: a shard cut on the meta device (by id) → (the meta parameter it was cut
        from, how), for `materialise`."""

    def all_to_all(
        self, rows: torch.Tensor, send: list[int], receive: list[int], backward: bool = False
    ) -> torch.Tensor:
        """`rows` split `send` to the group's ranks; what arrives, `receive` rows from each."""
        rows = rows.contiguous()
        out = rows.new_empty((sum(receive), *rows.shape[1:]))
        on_host = isinstance(self.clock, HostClock)
        issued = self.clock.mark()
        done = [0.0]
        work = dist.all_to_all_single(out, rows, receive, send, group=self.group, async_op=True)
        assert work is not None
        if on_host:  # a CPU exchange is done when its future is; a GPU's, when its stream passes the wait
            future = work.get_future()
            future.then(lambda _: done.__setitem__(0, time.perf_counter()))
        turn = pass_baton()  # issuing is this rank's own time: exposed, never hidden
        work.wait()
        if on_host:
            future.wait()
            finished = min(done[0] or time.perf_counter(), time.perf_counter())
        else:
            finished = self.clock.mark()
        row_bytes = rows[0].numel() * rows.element_size() if len(rows) else 0
        self.traffic.sent_bytes += (sum(send) - send[self.index]) * row_bytes
        self.traffic.flights.append(_Flight(issued, finished, turn, backward))
        return out

    def set_up_done(self) -> None:
        """Forget the full parameters the shards were cut from."""
        self.cuts.clear()


class _Exchange(torch.autograd.Function):
    """An all-to-all whose gradient is the reverse all-to-all."""

    @staticmethod
    def forward(ctx, rows, exchange, send, receive):  # noqa: D401 - autograd signature
        ctx.exchange, ctx.send, ctx.receive = exchange, send, receive
        return exchange.all_to_all(rows, send, receive)

    @staticmethod
    def backward(ctx, grad):
        return ctx.exchange.all_to_all(grad, ctx.receive, ctx.send, backward=True), None, None, None


@dataclass
class _Route:
    order: torch.Tensor
    """(token, choice) pairs sorted by expert, as flat indices into top_k_index."""
    top_k: int
    weights: torch.Tensor
    send: list[int]
    receive: list[int]
    hidden: torch.Tensor
    """The tokens' hidden states as the experts module received them (the combine's shape)."""
    segments: list[tuple[int, int, int]] = field(default_factory=list)
    """(local expert, first row, end row) of the rows received, in their order (by source rank,
    then expert): host numbers, so the experts run without reading the device."""


class _RoutedExperts:
    """The hooks around one experts module; the route of each call waits, by thread, for its
    combine (the two ops of a pair run on two threads)."""

    def __init__(self, exchange: ExpertExchange) -> None:
        self.exchange = exchange
        self.routes: dict[int, _Route] = {}

    def dispatch(self, module: nn.Module, args: tuple) -> tuple:
        hidden, top_k_index, top_k_weights = args
        exchange, top_k = self.exchange, top_k_index.shape[-1]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=exchange.num_experts)
        even = [exchange.local] * exchange.size
        arriving = exchange.all_to_all(counts, even, even)  # per source rank, per local expert
        # The layer's one read of the device: how many rows go to and come from each rank, which
        # an uneven all-to-all needs on the host (and the tokens per expert, for the record).
        known = torch.cat((counts, arriving)).tolist()
        sent, came = known[: exchange.num_experts], known[exchange.num_experts :]
        if torch.is_grad_enabled():
            for expert, count in enumerate(sent):
                exchange.traffic.tokens[expert] += count
        local = exchange.local
        send = [sum(sent[r * local : (r + 1) * local]) for r in range(exchange.size)]
        receive = [sum(came[r * local : (r + 1) * local]) for r in range(exchange.size)]
        rows = _Exchange.apply(hidden[order // top_k], exchange, send, receive)
        segments, first = [], 0
        for index, count in enumerate(came):
            segments.append((index % local, first, first + count))
            first += count
        route = _Route(order, top_k, top_k_weights, send, receive, hidden, segments)
        self.routes[threading.get_ident()] = route
        return rows, None, None

    def experts(self, module: nn.Module, rows: torch.Tensor, *_unused) -> torch.Tensor:
        """The module's forward on the rows received: each local expert's rows gathered by the
        host's counts and run through the library's weights and gate (`_apply_gate`) as its
        eager loop runs them — which itself finds each expert's rows on the device and reads
        them on the host, expert by expert, while the library's sync-free kernel (grouped_mm)
        takes bfloat16 on CUDA only."""
        route = self.routes[threading.get_ident()]
        pieces: list[torch.Tensor | None] = [None] * len(route.segments)
        for expert in range(self.exchange.local):
            mine = [(i, low, high) for i, (e, low, high) in enumerate(route.segments) if e == expert and high > low]
            if not mine:
                continue
            x = torch.cat([rows[low:high] for _, low, high in mine])
            y = _expert(module, expert, x).to(rows.dtype)
            offset = 0
            for i, low, high in mine:
                pieces[i] = y[offset : offset + high - low]
                offset += high - low
        made = [piece for piece in pieces if piece is not None]
        if not made:  # skewed routing sent every token elsewhere: an expert on no rows, so that
            # the graph still runs through the exchanges (this rank's backward runs both reverse
            # all-to-alls as its peers do) and through the weights (their gradient is zero, not
            # missing: AdamW's moments move as they do for the whole stacked weight in one process)
            return _expert(module, 0, rows).to(rows.dtype)
        return torch.cat(made)

    def combine(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        route = self.routes.pop(threading.get_ident())
        back = _Exchange.apply(output, self.exchange, route.receive, route.send)
        weighted = back * route.weights.reshape(-1)[route.order].unsqueeze(-1)
        hidden = route.hidden
        return torch.zeros_like(hidden).index_add(0, route.order // route.top_k, weighted.to(hidden.dtype))


def _expert(module: Any, expert: int, x: torch.Tensor) -> torch.Tensor:
    """One expert of the library's stacked experts module on its rows, as the module's own
    attributes say (`use_experts_implementation`: gated or not, biased, transposed weights)."""
    gated, biased = getattr(module, "has_gate", True), getattr(module, "has_bias", False)
    transposed = getattr(module, "is_transposed", False)
    up = module.gate_up_proj if gated else module.up_proj
    up_bias = (module.gate_up_proj_bias if gated else module.up_proj_bias)[expert] if biased else None
    h = _linear(x, up[expert], up_bias, transposed)
    h = module._apply_gate(h) if gated else module.act_fn(h)
    y = _linear(h, module.down_proj[expert], module.down_proj_bias[expert] if biased else None, transposed)
    return module.post_expert_norm(y) if getattr(module, "has_post_expert_norm", False) else y


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    if transposed:
        return x @ weight + bias if bias is not None else x @ weight
    return nn.functional.linear(x, weight, bias)


def _experts_modules(stage: nn.Module, pattern: str) -> list[nn.Module]:
    return [module for name, module in stage.named_modules() if fnmatch.fnmatchcase(name, pattern)]


def expert_parameter_ids(stages, pattern: str) -> set[int]:
    """Ids of the routed experts' parameters in `stages` (before any is cut)."""
    return {id(p) for stage in stages for module in _experts_modules(stage, pattern) for p in module.parameters()}


def shard_experts(stages: dict[int, nn.Module], pattern: str, exchange: ExpertExchange) -> dict[int, nn.Parameter]:
    """Keep this rank's experts of every module matching `pattern` (the library's stacked expert
    weights, experts first) and route around them; returns full parameter id → its slice."""
    cut = Cut(0, exchange.index, exchange.size)
    shards: dict[int, nn.Parameter] = {}
    for stage in stages.values():
        for module in _experts_modules(stage, pattern):
            for name, full in list(module.named_parameters(recurse=False)):
                if full.shape[0] != exchange.num_experts:
                    raise RuntimeError(f"{type(module).__name__}.{name} is not stacked by expert: {tuple(full.shape)}")
                local = cut.of(full.detach())
                shard = nn.Parameter(
                    torch.empty_like(local) if full.is_meta else local.clone(), requires_grad=full.requires_grad
                )
                setattr(module, name, shard)
                shards[id(full)] = shard
                exchange.sharded.add(id(shard))
                if full.is_meta:
                    exchange.cuts[id(shard)] = (full, cut)
            module.num_experts = exchange.local  # type: ignore[assignment]  # the library counts local experts
            routed = _RoutedExperts(exchange)
            module.forward = partial(routed.experts, module)  # type: ignore[method-assign]
            module.register_forward_pre_hook(routed.dispatch)
            module.register_forward_hook(routed.combine)
    return shards
