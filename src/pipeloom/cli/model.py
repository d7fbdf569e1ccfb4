"""`--model`, `--data`, `--tokenizer` of `train` and `profile`: which model and which tokens.

`--model` takes `hf:PATH` (a transformers directory or config.json), `torchvision:resnet18`
(… resnet152, on synthetic images), or — as before — a preset name or a model JSON, which the
built-in LLaMA-style decoder trains. Without `--model` the size flags (--layers, --hidden, …)
describe the built-in decoder. Torch and transformers are imported only when a run starts.
"""

from __future__ import annotations

import argparse

from pipeloom.errors import ConfigError

__all__ = ["add_model_arguments", "add_data_arguments", "data_from_args", "workload_from_args", "eval_batch_of"]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model and data")
    group.add_argument(
        "--model",
        metavar="SPEC",
        help="hf:DIR (a transformers LLaMA/Mistral/Qwen2/GPT-2/BERT/Mamba directory or config.json; weights from "
        "local safetensors if present), torchvision:resnet18..resnet152, or a preset/JSON for the built-in decoder",
    )
    add_data_arguments(group)
    group.add_argument(
        "--image-size", type=int, default=32, help="torchvision models: image side in pixels (default 32)"
    )


def add_data_arguments(group) -> None:
    """--data, --data-dtype and --tokenizer (`data_from_args` reads them)."""
    group.add_argument(
        "--data",
        metavar="PATH",
        help="a flat token file (uint16/uint32 .bin, memory-mapped) or, with --tokenizer, text",
    )
    group.add_argument(
        "--data-dtype", choices=("uint16", "uint32"), help="token file id type (default: uint16; .u32 → uint32)"
    )
    group.add_argument("--tokenizer", metavar="DIR", help="tokenize the --data text file with this local tokenizer")


def data_from_args(args, seq_len: int):
    """The --data source (a token file, or text through --tokenizer); None: synthetic tokens."""
    if args.tokenizer and not args.data:
        raise ConfigError("--tokenizer tokenizes the --data text file: give --data too")
    if args.data_dtype and not args.data:
        raise ConfigError("--data-dtype describes a --data token file: give --data too")
    if not args.data:
        return None
    from pipeloom.data import open_tokens

    return open_tokens(args.data, seq_len, getattr(args, "seed", 0), args.tokenizer, args.data_dtype)


def workload_from_args(args: argparse.Namespace, layer_counts=None, microbatch_size: int | None = None):
    """(workload or None for the built-in decoder's flags, LlamaConfig or None)."""
    from pipeloom.models.llama import LlamaConfig

    mbs = microbatch_size or args.microbatch_size
    spec = args.model
    if spec and spec.startswith("hf:"):
        from pipeloom.models.hf import hf_workload

        path = spec[3:]
        if not path:
            raise ConfigError("--model hf: needs a path, e.g. hf:./my-llama")
        return hf_workload(path, args.seed, mbs, args.seq_len, layer_counts, data_from_args(args, args.seq_len)), None
    if spec and spec.startswith("torchvision:"):
        if args.data:
            raise ConfigError("--data feeds language models; torchvision models train on synthetic images")
        from pipeloom.models.vision import resnet_workload

        return resnet_workload(spec.split(":", 1)[1], mbs, args.image_size, seed=args.seed, counts=layer_counts), None
    if spec:
        from pipeloom.models.llama import llama_config
        from pipeloom.tune.presets import load_model

        model = load_model(spec)
        config = llama_config(model, model.layers, mbs)
    else:
        config = LlamaConfig(
            vocab=args.vocab,
            hidden=args.hidden,
            layers=args.layers,
            heads=args.heads,
            ffn=args.ffn,
            seq_len=args.seq_len,
            microbatch_size=mbs,
        )
    data = data_from_args(args, config.seq_len)
    if data is None:
        return None, config
    from pipeloom.models.workload import llama_workload

    if data.vocab_limit > config.vocab:
        raise ConfigError(
            f"data: token ids reach {data.vocab_limit - 1}, beyond the model's vocabulary of {config.vocab} (--vocab)"
        )
    return llama_workload(config, args.seed, layer_counts, data), config


def eval_batch_of(args, workload):
    """`--eval-data`'s batches, prepared as the training data is (`Workload.prepare`: a BERT
    model's masked), checked against the model's vocabulary; None without it."""
    if not getattr(args, "eval_data", None):
        return None
    from pipeloom.data import open_tokens

    source = open_tokens(args.eval_data, workload.sample_tokens, args.seed, args.tokenizer, args.data_dtype)
    if workload.vocab is not None and source.vocab_limit > workload.vocab:
        raise ConfigError(
            f"data: --eval-data token ids reach {source.vocab_limit - 1}, beyond the model's vocabulary of "
            f"{workload.vocab}"
        )
    return workload.prepare(source) if workload.prepare is not None else source.batch
