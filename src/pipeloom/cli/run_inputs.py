"""`tune --data PATH [--tokenizer DIR | --data-dtype T]`: the plan's record of its run's inputs
(`tune.run_inputs`), made where reading the data is allowed — the planning core does not."""

from __future__ import annotations

from pathlib import Path

from pipeloom.errors import ConfigError
from pipeloom.tune.run_inputs import RunInputs

__all__ = ["plan_inputs"]


def plan_inputs(
    data: str | None,
    tokenizer: str | None,
    data_dtype: str | None,
    dtype: str | None,
    vocab: int | None,
    seq_len: int = 1,
    *,
    device: str | None = None,
    threads: int | None = None,
) -> RunInputs:
    """The record of `tune --data PATH [--tokenizer DIR | --data-dtype T]`, checked now (the file
    exists; a token file holds a sequence of the model's `seq_len` and its ids fit the model's
    vocabulary) so a plan never names data it cannot train on."""
    from pipeloom import provenance

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

        tokens = TokenFile(data, seq_len=seq_len, seed=0, dtype=data_dtype)
        if vocab is not None and tokens.vocab_limit > vocab:
            raise ConfigError(
                f"data: token ids in {data!r} reach {tokens.vocab_limit - 1}, beyond the model's vocabulary of {vocab}"
            )
        record = tokens.provenance
    return RunInputs(record, dtype, device, threads)
