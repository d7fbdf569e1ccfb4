"""What a plan records of its run's inputs — the data (`pipeloom.data.provenance`) and the compute
type its costs were measured in — so that `train --plan` trains on them without being told again.

    "inputs": {"data": {...provenance record...} or null, "dtype": "bf16" or null}

null: not known when the plan was made (synthetic tokens; the runtime's default type).
"""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import ConfigError

__all__ = ["plan_inputs", "check_inputs"]

DTYPES = ("fp32", "bf16", "fp16")


def plan_inputs(
    data: str | None, tokenizer: str | None, data_dtype: str | None, dtype: str | None, vocab: int | None
) -> dict:
    """The record of `tune --data PATH [--tokenizer DIR | --data-dtype T]`, checked now (the file
    exists; a token file's ids fit the model's vocabulary) so a plan never names data it cannot
    train on."""
    from pipeloom.data import provenance

    if (tokenizer or data_dtype) and not data:
        raise ConfigError("--tokenizer and --data-dtype describe --data PATH: give --data too")
    if tokenizer and data_dtype:
        raise ConfigError("--data-dtype describes a token file; a text file given with --tokenizer has none")
    record = None
    if data and tokenizer:
        if not Path(data).is_file() or not Path(tokenizer).is_dir():
            missing = data if not Path(data).is_file() else tokenizer
            raise ConfigError(f"data: {missing!r} does not exist")
        record = provenance.text_file(data, tokenizer)
    elif data:
        from pipeloom.data import TokenFile

        tokens = TokenFile(data, seq_len=1, seed=0, dtype=data_dtype)
        if vocab is not None and tokens.vocab_limit > vocab:
            raise ConfigError(
                f"data: token ids in {data!r} reach {tokens.vocab_limit - 1}, beyond the model's vocabulary of {vocab}"
            )
        record = tokens.provenance
    return {"data": record, "dtype": dtype}


def check_inputs(inputs: object, where: str) -> dict:
    """A plan's `inputs` as read from its file: a mapping of a known data kind and compute type."""
    if not isinstance(inputs, dict):
        raise ConfigError(f"{where}: field 'inputs' must be an object, got {inputs!r}")
    data, dtype = inputs.get("data"), inputs.get("dtype")
    if data is not None and (not isinstance(data, dict) or data.get("kind") not in ("synthetic", "tokens", "text")):
        raise ConfigError(f"{where}: field 'inputs.data' is not a data record (kind synthetic, tokens or text)")
    if isinstance(data, dict) and data.get("kind") in ("tokens", "text") and not isinstance(data.get("path"), str):
        raise ConfigError(f"{where}: field 'inputs.data' names no file ('path')")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"{where}: field 'inputs.dtype' must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return {"data": data, "dtype": dtype}
