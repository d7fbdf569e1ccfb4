"""Training data: synthetic tokens, a flat token file read by numpy memmap, or plain text
tokenized once with a local tokenizer — all sampled deterministically.

Every source answers `batch(rows, step)` with (tokens, next-token targets) of `rows` sequences,
drawn from (seed, step) alone; data-parallel replica k trains rows k·m·b .. (k+1)·m·b − 1 of it.
So every rank, the single-process reference and a resumed run see exactly the same samples, and
a run resumed at step n continues on step n's samples. The token file is the nanoGPT / Megatron
`.bin` layout: token ids back to back, uint16 or uint32, no header.
"""

from __future__ import annotations

import functools
from pathlib import Path

from pipeloom import provenance as records
from pipeloom.errors import ConfigError

__all__ = [
    "SyntheticTokens",
    "TokenFile",
    "TextTokens",
    "open_tokens",
    "open_recorded",
    "masked_lm",
    "write_token_file",
    "sample_corpus",
    "train_tokenizer",
    "load_tokenizer",
    "check_seed",
    "SEED_LIMIT",
]

_DTYPES = {"uint16": 2, "uint32": 4}
SEED_LIMIT = 2**32
"""Seeds lie in [0, 2³²): numpy's generators take no negative seed, and torch's none past 2⁶⁴
once a step is folded in (a `--seed -1` failed inside the first batch)."""


def check_seed(seed) -> int:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < SEED_LIMIT:
        raise ConfigError(f"the seed must be an integer in [0, 2**32), got {seed!r}")
    return seed


class SyntheticTokens:
    """Uniform random token ids from (seed, step): the default, needing no file."""

    def __init__(self, vocab: int, seq_len: int, seed: int) -> None:
        self.vocab, self.seq_len, self.seed = vocab, seq_len, check_seed(seed)
        self.vocab_limit = vocab

    @property
    def provenance(self) -> dict:
        return records.synthetic(self.vocab, self.seed)

    def batch(self, rows: int, step: int):
        import torch

        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        tokens = torch.randint(0, self.vocab, (rows, self.seq_len + 1), generator=generator)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


class _Sampled:
    """Windows of seq_len + 1 tokens at offsets drawn from (seed, step)."""

    seq_len: int
    seed: int

    def _tokens(self):
        raise NotImplementedError

    def batch(self, rows: int, step: int):
        import numpy as np
        import torch

        tokens = self._tokens()
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, len(tokens) - self.seq_len, size=rows)
        windows = np.stack([np.asarray(tokens[s : s + self.seq_len + 1], dtype=np.int64) for s in starts])
        window = torch.from_numpy(windows)
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def _check_length(self, count: int, what: str) -> None:
        if count < self.seq_len + 1:
            raise ConfigError(f"data: {what} holds {count} tokens, fewer than one sequence of {self.seq_len} + 1")


class TokenFile(_Sampled):
    """A flat file of uint16 or uint32 token ids, memory-mapped (never read whole)."""

    def __init__(self, path: str | Path, seq_len: int, seed: int, dtype: str | None = None) -> None:
        import numpy as np

        self.path, self.seq_len, self.seed = Path(path), seq_len, check_seed(seed)
        if not self.path.is_file():
            raise ConfigError(f"data: token file {str(self.path)!r} does not exist")
        self.dtype = dtype or ("uint32" if self.path.suffix in (".u32", ".uint32") else "uint16")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"data: token dtype must be uint16 or uint32, got {self.dtype!r}")
        size = self.path.stat().st_size
        if size == 0:
            raise ConfigError(f"data: token file {str(self.path)!r} is empty: it holds no tokens")
        if size % _DTYPES[self.dtype]:
            raise ConfigError(
                f"data: {str(self.path)!r} has {size} bytes, not a multiple of {self.dtype}'s {_DTYPES[self.dtype]}"
                " (wrong --data-dtype, or a truncated file)"
            )
        self._memmap = np.memmap(self.path, dtype=self.dtype, mode="r")
        self._check_length(len(self._memmap), repr(str(self.path)))
        self.vocab_limit = int(_chunked_max(self._memmap)) + 1

    @functools.cached_property
    def provenance(self) -> dict:
        return records.token_file(self.path, self.dtype)

    def _tokens(self):
        return self._memmap


class TextTokens(_Sampled):
    """A plain-text file, tokenized once (per process) with a tokenizer from a local directory."""

    def __init__(self, path: str | Path, tokenizer_dir: str | Path, seq_len: int, seed: int) -> None:
        import numpy as np

        self.seq_len, self.seed = seq_len, check_seed(seed)
        self.path, self.tokenizer_dir = Path(path), Path(tokenizer_dir)
        path = self.path
        if not path.is_file():
            raise ConfigError(f"data: text file {str(path)!r} does not exist")
        raw = path.read_bytes()
        try:
            if b"\x00" in raw:  # a uint16/uint32 token file: small ids are NUL bytes
                raise UnicodeError("it holds NUL bytes")
            text = raw.decode("utf-8")
        except UnicodeError as error:
            raise ConfigError(
                f"data: {str(path)!r} is not UTF-8 text ({str(error).split(':')[-1].strip()}): a token file "
                "(uint16/uint32 ids) is read without --tokenizer"
            ) from None
        tokenizer = load_tokenizer(tokenizer_dir)
        ids = tokenizer(text)["input_ids"]
        self._ids = np.asarray(ids, dtype=np.int64)
        self._check_length(len(self._ids), f"{str(path)!r} tokenized")
        self.vocab_limit = int(self._ids.max()) + 1

    @functools.cached_property
    def provenance(self) -> dict:
        return records.text_file(self.path, self.tokenizer_dir)

    def _tokens(self):
        return self._ids


def load_tokenizer(directory: str | Path):
    from pipeloom.models.compat import import_transformers

    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"data: tokenizer directory {str(directory)!r} does not exist")
    transformers = import_transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as error:
        raise ConfigError(f"data: no tokenizer in {str(directory)!r}: {str(error).splitlines()[0]}") from None


def open_tokens(
    path: str | Path, seq_len: int, seed: int, tokenizer: str | Path | None = None, dtype: str | None = None
):
    """`--data PATH [--tokenizer DIR]`: a token file, or text when a tokenizer is given."""
    if tokenizer is not None:
        return TextTokens(path, tokenizer, seq_len, seed)
    if Path(path).suffix in (".txt", ".md", ".text"):
        raise ConfigError(f"data: {str(path)!r} looks like text; give --tokenizer DIR to tokenize it")
    return TokenFile(path, seq_len, seed, dtype)


def open_recorded(record: dict, seq_len: int, seed: int):
    """The source a plan's data record names (`provenance`), or None for synthetic tokens; a
    file that is gone is refused, one that changed since the record is read with a warning."""
    import sys

    if record.get("kind") not in ("tokens", "text"):
        return None
    path = Path(record["path"])
    if not path.is_file():
        raise ConfigError(
            f"data: the plan was made for {records.describe(record)}, which does not exist here: give --data PATH"
        )
    tokenizer = record.get("tokenizer")
    source = open_tokens(path, seq_len, seed, tokenizer, record.get("dtype") if tokenizer is None else None)
    changed = records.differences(record, source.provenance)
    if changed:
        print(f"pipeloom: warning: data changed since the plan was made: it was {changed[0]}", file=sys.stderr)
    return source


def write_token_file(path: str | Path, ids, dtype: str = "uint16") -> Path:
    """Write token ids in the flat `.bin` layout (for tests, demos and converting corpora)."""
    import numpy as np

    path = Path(path)
    np.asarray(ids, dtype=dtype).tofile(path)
    return path


def masked_lm(source, vocab: int, seed: int, probability: float = 0.15):
    """BERT's objective over a token source: a share of positions replaced by the mask id (the
    last id of the vocabulary), targets the original ids there and -100 (ignored) elsewhere; at
    least one masked position per sequence. Positions are drawn from (seed, step)."""
    import torch

    check_seed(seed)

    def batch(rows: int, step: int):
        tokens, _ = source.batch(rows, step)
        generator = torch.Generator().manual_seed(seed * 7_919 + step)
        chosen = torch.rand(tokens.shape, generator=generator) < probability
        chosen[:, 0] |= ~chosen.any(dim=1)
        inputs = torch.where(chosen, torch.full_like(tokens, vocab - 1), tokens)
        targets = torch.where(chosen, tokens, torch.full_like(tokens, -100))
        return inputs, targets

    return batch


def _chunked_max(array, chunk: int = 1 << 24) -> int:
    return max(int(array[i : i + chunk].max()) for i in range(0, len(array), chunk))


def sample_corpus(max_chars: int = 400_000) -> str:
    """English text this machine already has, for tests and demos (nothing is downloaded): the
    Python license and the docstrings of standard-library modules, in a fixed order."""
    import importlib
    import os

    parts = []
    license_file = Path(os.__file__).parent / "LICENSE.txt"
    if license_file.is_file():
        parts.append(license_file.read_text(encoding="utf-8", errors="replace"))
    for name in (
        "argparse",
        "json",
        "textwrap",
        "collections",
        "functools",
        "itertools",
        "pathlib",
        "logging",
        "unittest",
        "email",
        "http.client",
        "subprocess",
        "threading",
        "dataclasses",
    ):
        module = importlib.import_module(name)
        parts += [
            obj.__doc__ for obj in [module, *vars(module).values()] if isinstance(getattr(obj, "__doc__", None), str)
        ]
    return "\n\n".join(parts)[:max_chars]


def train_tokenizer(directory: str | Path, text: str, vocab_size: int = 2048) -> Path:
    """A byte-level BPE tokenizer trained on `text` with the `tokenizers` library and saved as a
    transformers tokenizer directory (for `--tokenizer`, tests and the demo)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from pipeloom.models.compat import import_transformers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator([text], trainer=trainer)
    fast = import_transformers().PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    directory = Path(directory)
    fast.save_pretrained(str(directory))
    return directory
