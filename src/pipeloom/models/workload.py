"""What the runtime trains: stage modules, the data of a step, the loss — for any model.

`llama_workload` is the default (the small LLaMA-style decoder on synthetic tokens);
`blocks_workload` cuts any list of nn.Module blocks into stages; `pipeloom.models.hf` and
`pipeloom.models.vision` build Hugging Face and torchvision models the same way. Every rank calls
`build` (or, where a workload has one, `skeleton`: the stages on the meta device, made real only
in the part a rank holds) and must get identical stages (seed inside it), so that all copies start
from the same weights. Parameters shared between stages (tied input and output embeddings) are found by
identity, so nothing needs declaring. What crosses each stage boundary is inferred from one
example micro-batch (`runtime.boundary`), so boundaries may differ in shape and carry tuples.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipeloom.models.cut import counts_per_stage
from pipeloom.models.llama import LlamaConfig, build_stages, stage_skeleton, synthetic_batch
from pipeloom.provenance import synthetic

__all__ = [
    "Workload",
    "TensorParallelPlan",
    "ExpertPlan",
    "llama_workload",
    "blocks_workload",
    "token_loss",
    "cut_blocks",
    "rows_of",
    "replica_microbatches",
    "global_names",
    "layout_free",
]

Batch = tuple[torch.Tensor | tuple[torch.Tensor, ...], torch.Tensor]


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a model's stages split over a tensor-parallel group (`runtime.tensor_parallel`)."""

    modules: dict[str, str]
    """Module path inside a stage (`*` matches one name) → its role: colwise, rowwise,
    packed_colwise3 (a fused q/k/v), vocab_embedding(_replicated), vocab_head, scatter_after."""
    full_sequence: tuple[str, ...] = ()
    """Under sequence parallelism, modules that still see the whole sequence (their replicated
    parameters' gradients are whole, not partial)."""
    adjust: Callable[[nn.Module, int, int, bool], None] | None = None
    """(stage, tp, tp index, sequence parallel) → fixes the stage's own bookkeeping to the shard
    (a fused projection's split size; which positions a sequence shard holds)."""


@dataclass(frozen=True)
class ExpertPlan:
    """Where a mixture-of-experts model keeps its routed experts (`runtime.expert_parallel`)."""

    num_experts: int
    """Routed experts per MoE layer."""
    modules: str
    """Path of each MoE layer's experts module inside a stage (`*` matches one name): the
    library's stacked expert weights, called as experts(hidden, top_k_index, top_k_weights)."""


@dataclass(frozen=True)
class Workload:
    build: Callable[[int], Sequence[nn.Module]]
    """Number of stages → the stage modules, identical on every call."""
    batch: Callable[[int, int], Batch]
    """(rows, step) → inputs (a tensor or a tuple of them) and targets of a step, identical on every
    rank; replica k trains rows k·m·b .. (k+1)·m·b − 1."""
    loss: Callable[[Any, Any], torch.Tensor]
    """Last stage's output and targets of one micro-batch → its mean loss."""
    microbatch_size: int
    sample_tokens: int = 1
    """Tokens per sample (the sequence length), for tokens/s; 1 for images."""
    name: str = "model"
    check: Callable[[int], object] | None = None
    """Number of stages → raises ConfigError if the model cannot be cut so (before any compute)."""
    tensor_parallel: Callable[[int, bool], TensorParallelPlan] | None = None
    """(tp, sequence parallel) → the plan, or ConfigError when heads, columns or the vocabulary do
    not divide; None: the model has no tensor-parallel plan."""
    experts: ExpertPlan | None = None
    """A mixture of experts: where its routed experts are; None: a dense model."""
    vocab: int | None = None
    """A language model's vocabulary: the token ids any data it reads must stay below."""
    prepare: Callable[[Any], Callable[[int, int], Batch]] | None = None
    """A token source (`pipeloom.data`) → its batches as this model trains on them (BERT masks
    them); None: the source's own `batch`. Held-out data goes through it too."""
    description: dict | None = None
    """What the model is, as JSON, for checkpoints and `pipeloom export`: a Hugging Face model's
    {"kind": "hf", "family", "config" (its config.json), "source"}; None: nothing to export from."""
    skeleton: Callable[[int], Any] | None = None
    """Number of stages → the stages on the meta device with the source of their values
    (`pipeloom.models.materialise.Skeleton`), so a rank makes real only what it holds; None: the
    runtime builds the whole model (`build`) and keeps its part."""
    data: dict | None = None
    """What it trains on (`pipeloom.provenance`), for headers, plans and checkpoints' resume
    checks; None: batches the caller made, unnamed."""
    context_parallel: Callable[[nn.Module, Any], None] | None = None
    """(stage, `models.context_parallel.ContextShard`) → the stage runs on that share of every
    sequence, gathering keys and values over its group; None: the model cannot (absolute or
    no positions, bidirectional attention, no attention), and `--cp` is refused."""


def token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose target is not -100 (masked LM's convention)."""
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def rows_of(inputs: torch.Tensor | tuple[torch.Tensor, ...], rows: slice) -> tuple[torch.Tensor, ...]:
    """The rows of a step's inputs that form one micro-batch, always as a tuple."""
    if isinstance(inputs, torch.Tensor):
        return (inputs[rows],)
    return tuple(t[rows] for t in inputs)


def replica_microbatches(
    batch: Callable[[int, int], Batch],
    index: int,
    dp: int,
    replica: int,
    m: int,
    b: int,
    where: torch.device,
    context: Any = None,
) -> tuple[list[tuple[torch.Tensor, ...]], list]:
    """Replica `replica`'s m micro-batches of b rows of batch `index` (drawn for all dp replicas),
    on `where`: (inputs per micro-batch, targets per micro-batch); with `context` (a
    `models.context_parallel.ContextShard`), this rank's share of each row's sequence."""
    inputs, targets = batch(dp * m * b, index)
    rows = [slice((replica * m + j) * b, (replica * m + j + 1) * b) for j in range(m)]

    def own(tensor: torch.Tensor) -> torch.Tensor:
        return (context.cut(tensor) if context is not None else tensor).to(where)

    return [tuple(own(t) for t in rows_of(inputs, r)) for r in rows], [own(targets[r]) for r in rows]


def llama_workload(config: LlamaConfig, seed: int, layer_counts: Sequence[int] | None = None, data=None) -> Workload:
    """The built-in decoder; `data` (a `pipeloom.data` source) replaces the synthetic tokens."""
    batch = data.batch if data is not None else (lambda rows, step: synthetic_batch(config, rows, seed, step))
    return Workload(
        build=lambda num_stages: build_stages(config, num_stages, seed, layer_counts),
        skeleton=lambda num_stages: stage_skeleton(config, num_stages, seed, layer_counts),
        batch=batch,
        loss=token_loss,
        microbatch_size=config.microbatch_size,
        sample_tokens=config.seq_len,
        name="llama (built-in)",
        vocab=config.vocab,
        description={"kind": "llama", "config": dataclasses.asdict(config)},
        data=data.provenance if data is not None else synthetic(config.vocab, seed),
    )


def cut_blocks(
    made: Sequence[nn.Module], num_stages: int, counts: Sequence[int] | None = None
) -> list[list[nn.Module]]:
    """Consecutive blocks per stage: as counted, or balanced (the earlier stages take the remainder)."""
    sizes = counts_per_stage(len(made), num_stages, counts, "blocks")
    out, first = [], 0
    for size in sizes:
        out.append(list(made[first : first + size]))
        first += size
    return out


class BlockStage(nn.Sequential):
    """Consecutive blocks; a block may take and return a tuple, which is unpacked into the next."""

    def forward(self, *inputs):
        return _chain(list(self), inputs)

    def split_at(self, count: int):
        """(head, tail): the first `count` blocks, then the rest — for a checkpoint of part of the
        stage (`--recompute-layers`)."""
        blocks = list(self)
        return (lambda *x: _chain(blocks[:count], x)), (lambda *x: _chain(blocks[count:], x))


def _chain(blocks: Sequence[nn.Module], inputs: tuple):
    x = inputs
    for block in blocks:
        x = block(*x) if isinstance(x, tuple) else block(x)
    return x


def blocks_workload(
    blocks: Callable[[], Sequence[nn.Module]],
    batch: Callable[[int, int], Batch],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    activation_shape: Sequence[int] | None = None,
    microbatch_size: int = 1,
    counts: Sequence[int] | None = None,
    sample_tokens: int = 1,
    name: str = "blocks",
) -> Workload:
    """Any model given as consecutive blocks: stage s runs its share of them (balanced by default,
    the earlier stages taking the remainder, or `counts` per stage). What crosses each boundary
    — shapes, dtypes, tuples — is inferred from one micro-batch, so `activation_shape` is not
    needed (accepted for older callers and ignored)."""
    del activation_shape

    def build(num_stages: int) -> list[nn.Module]:
        return [BlockStage(*share) for share in cut_blocks(list(blocks()), num_stages, counts)]

    return Workload(build, batch, loss, microbatch_size, sample_tokens, name)


def global_names(stages: Sequence[nn.Module]) -> list[dict[str, str]]:
    """Per stage: each parameter's name in the whole model, the same however the model is cut —
    what checkpoints key weights by, so that one resumes under another schedule or pipeline size
    and exports to the model's own names. A stage that knows them (`model_names`, a Hugging Face
    stage: the library's names) says so; stacked layers (`layers`, or a block stage's children)
    are numbered through the whole model; any other stage keeps its index (``stage{s}.``), which
    ties its checkpoint to this cut."""
    out: list[dict[str, str]] = []
    offset = 0
    for index, stage in enumerate(stages):
        local = [name for name, _ in stage.named_parameters()]
        known = getattr(stage, "model_names", None)
        if isinstance(known, dict):
            out.append({name: known[name] for name in local})
        elif isinstance(stage, BlockStage):
            out.append({name: _renumbered(name, "", offset) for name in local})
            offset += len(stage)
        elif isinstance(layers := getattr(stage, "layers", None), nn.ModuleList):
            out.append({name: _renumbered(name, "layers.", offset) for name in local})
            offset += len(layers)
        else:
            out.append({name: f"stage{index}.{name}" for name in local})
    return out


def layout_free(names: Sequence[dict[str, str]]) -> bool:
    """Whether `global_names` named every parameter independently of the cut."""
    return not any(
        value.startswith("stage") and value.split(".", 1)[0][5:].isdigit() for n in names for value in n.values()
    )


def _renumbered(name: str, prefix: str, offset: int) -> str:
    """``{prefix}{i}.rest`` → ``{prefix}{offset + i}.rest`` (with an empty prefix: ``blocks.``)."""
    if not name.startswith(prefix):
        return name
    index, _, rest = name[len(prefix) :].partition(".")
    if not index.isdigit():
        return name
    return f"{prefix or 'blocks.'}{offset + int(index)}.{rest}"
