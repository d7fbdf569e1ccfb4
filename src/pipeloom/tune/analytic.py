"""Analytic FLOPs and memory of one transformer layer (Zero Bubble Table 1, Korthikanti et al.).

Per micro-batch of b sequences of s tokens, hidden h, a heads, tensor parallelism t, and P the
layer's weights (4h² + 2h·ffn for GPT, 2·ffn·h + h·ffn more for a gated MLP, less K/V with GQA):

* F = 2bs·P + 4bs²h, B = 2bs·P + 8bs²h (input gradients; attention's backward costs twice its
  forward), W = 2bs·P (weight gradients) — for GPT's P = 12h² exactly Zero Bubble's
  sbh(24h + 4s), sbh(24h + 8s), sbh(24h); all divided by t;
* activations kept for B (16-bit): Korthikanti's sbh(10 + 24/t + 5as/(ht)), with the MLP's
  part written for any ffn f — 4f per token, 8f when gated — so that GPT's ffn = 4h gives 34 + 5as/h
  at t = 1; FlashAttention drops the 5as²b scores;
* kept for W after B: the input and the output gradient of every weight GEMM, 2(in + out) bytes
  per token and matrix — Zero Bubble's 32sbh for GPT;
* a stage's input (what a checkpointed stage keeps): 2sbh;
* mixture of experts: a token's FLOPs run through its top-k experts, a GPU stores num_experts/EP
  of them, and each layer's forward and backward each cross two all-to-alls of 2sbh·k·(EP−1)/EP
  bytes (dispatch and combine), which the cost model prices as a2a_F and a2a_B;
* tensor parallelism: each layer's attention and MLP enter and leave the tp region once each
  way, an all-reduce of 2bsh bytes (or, with sequence parallelism, an all-gather and a
  reduce-scatter of the same bytes), in F and again in B (`tp_layout.layer_collectives`);
* context parallelism over c ranks: each holds two opposite chunks of the sequence (the head-tail
  balance), so a rank's tokens, FLOPs and activations are 1/c of the layer's — its queries meet
  the whole sequence's keys, which the causal mask halves evenly for every rank — and each layer
  all-gathers K and V (2bs·kv_hidden 16-bit values over c ranks) in F and reduce-scatters
  their gradients in B;
* the head: 2bs·hV FLOPs per pass and fp32 logits, 4bsV bytes; the embedding is a lookup;
* static memory per weight: as the runtime holds it under each ZeRO level or offload
  (`pipeloom.static_memory`): 16 bytes under ZeRO-0, 2 + 4 + 12/dp under ZeRO-1 in bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeloom.static_memory import static_bytes
from pipeloom.tune.presets import ModelSpec

__all__ = [
    "LayerFigures",
    "layer_figures",
    "head_figures",
    "stage_input_bytes",
    "all_to_all_bytes",
    "kv_exchange_bytes",
    "static_bytes_per_param",
]


@dataclass(frozen=True)
class LayerFigures:
    """One transformer layer (or the head) on one tensor-parallel rank, per micro-batch."""

    forward_flops: float
    backward_flops: float
    weight_flops: float
    activation_bytes: float
    weight_grad_bytes: float
    params: float


def layer_figures(
    model: ModelSpec, micro_batch: int, tp: int = 1, cp: int = 1, sequence_parallel: bool = False
) -> LayerFigures:
    """With `sequence_parallel`, the norms' and residuals' 10 bytes per token and hidden unit
    are split over the tp ranks too (Korthikanti's sbh·34/t)."""
    b, s, h, a = micro_batch, model.seq_len, model.hidden, model.heads
    tokens = b * s / cp
    linear = 2 * tokens * model.layer_params
    scores = 0.0 if model.flash_attention else 5 * a * s * s * b / cp
    mlp = (8 if model.gated else 4) * model.mlp_ffn * model.active_experts
    return LayerFigures(
        forward_flops=(linear + 4 * tokens * s * h) / tp,
        backward_flops=(linear + 8 * tokens * s * h) / tp,
        weight_flops=linear / tp,
        activation_bytes=tokens * (10 * h / (tp if sequence_parallel else 1) + (8 * h + mlp) / tp) + scores / tp,
        weight_grad_bytes=tokens * sum(2 * (i + o) for i, o in model.linears()) / tp,
        params=model.stored_layer_params / tp,
    )


def kv_exchange_bytes(model: ModelSpec, micro_batch: int, tp: int, cp: int) -> float:
    """Bytes one rank sends in a layer's K/V all-gather over `cp` ranks by the ring (and again in
    the backward's reduce-scatter of their gradients): (cp − 1) times its own K and V, of its
    tp share of the K/V heads."""
    if cp == 1:
        return 0.0
    local = 2 * 2 * micro_batch * (model.seq_len / cp) * model.kv_hidden / tp
    return (cp - 1) * local


def all_to_all_bytes(model: ModelSpec, micro_batch: int, cp: int = 1) -> float:
    """Bytes one GPU sends in one direction of a layer's expert all-to-all: each token's 16-bit
    hidden state to its top-k experts, of which (EP−1)/EP live on other GPUs. A forward does
    two (dispatch, combine), and so does a backward (their gradients); under cp, of its 1/cp
    of the tokens."""
    if not model.num_experts or model.expert_parallel == 1:
        return 0.0
    ep = model.expert_parallel
    return 2 * micro_batch * model.seq_len / cp * model.hidden * model.num_experts_per_tok * (ep - 1) / ep


def head_figures(model: ModelSpec, micro_batch: int, tp: int = 1, cp: int = 1) -> LayerFigures:
    """The output projection and loss: one GEMM of h × vocab per pass, fp32 logits kept."""
    tokens = micro_batch * model.seq_len / cp
    flops = 2 * tokens * model.hidden * model.vocab / tp
    return LayerFigures(
        forward_flops=flops,
        backward_flops=flops,
        weight_flops=flops,
        activation_bytes=4 * tokens * model.vocab / tp,
        weight_grad_bytes=2 * tokens * (model.hidden + model.vocab) / tp,
        params=model.hidden * model.vocab / tp,
    )


def stage_input_bytes(model: ModelSpec, micro_batch: int, cp: int = 1) -> float:
    """The hidden states entering a stage (a rank's 1/cp of the sequence): what a checkpointed
    stage keeps, and what p2p moves."""
    return 2 * micro_batch * model.seq_len / cp * model.hidden


def static_bytes_per_param(dp: int, zero: int = 0) -> float:
    """Device bytes per weight in bf16 training under a ZeRO level (`static_memory`)."""
    return static_bytes(1.0, dp, zero).device
