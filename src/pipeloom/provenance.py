"""What a run trained on, as JSON that plans and checkpoints carry: so `train --plan` reads the
data the plan was made for, a resume refuses other data, and every report names its data.

A record is one of
    {"kind": "synthetic", "vocab": V, "seed": S}
    {"kind": "tokens", "path": ABS, "dtype": "uint16", "bytes": N, "sha256": HEX}
    {"kind": "text", "path": ABS, "tokenizer": ABS_DIR, "bytes": N, "sha256": HEX, "tokenizer_sha256": HEX}
    {"kind": "images", "what": "synthetic images"}
Two records name the same data when their contents agree (`differences` ignores where a file
lies, so a moved corpus still resumes). Hashing a multi-gigabyte corpus whole would cost minutes
at every start, so files over 64 MiB are fingerprinted by their size and 1 MiB read at 64 evenly
spaced offsets: any truncation, append or rewrite of a region changes it.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

__all__ = [
    "fingerprint", "directory_fingerprint", "differences", "describe", "token_file", "text_file", "synthetic", "byte_size",
]  # fmt: skip

_WHOLE = 64 << 20
_SAMPLES, _SAMPLE = 64, 1 << 20


def fingerprint(path: str | Path) -> str:
    """SHA-256 of the file's size and contents (whole up to 64 MiB, else 64 spaced 1 MiB samples)."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with open(path, "rb") as handle:
        if size <= _WHOLE:
            digest.update(handle.read())
        else:
            stride = (size - _SAMPLE) // (_SAMPLES - 1)
            for index in range(_SAMPLES):
                handle.seek(index * stride)
                digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()


def directory_fingerprint(directory: str | Path) -> str:
    """SHA-256 over a tokenizer directory's files (names and contents, in name order)."""
    digest = hashlib.sha256()
    for entry in sorted(Path(directory).iterdir()):
        if entry.is_file():
            digest.update(entry.name.encode() + b"\0" + fingerprint(entry).encode())
    return digest.hexdigest()


def synthetic(vocab: int, seed: int) -> dict:
    return {"kind": "synthetic", "vocab": vocab, "seed": seed}


def token_file(path: str | Path, dtype: str) -> dict:
    path = Path(path).resolve()
    return {
        "kind": "tokens",
        "path": str(path),
        "dtype": dtype,
        "bytes": path.stat().st_size,
        "sha256": fingerprint(path),
    }


def text_file(path: str | Path, tokenizer: str | Path) -> dict:
    path, tokenizer = Path(path).resolve(), Path(tokenizer).resolve()
    return {
        "kind": "text",
        "path": str(path),
        "tokenizer": str(tokenizer),
        "bytes": path.stat().st_size,
        "sha256": fingerprint(path),
        "tokenizer_sha256": directory_fingerprint(tokenizer),
    }


_CONTENT = {  # the keys that decide what the samples are; paths only say where they were
    "synthetic": ("vocab", "seed"),
    "tokens": ("dtype", "bytes", "sha256"),
    "text": ("bytes", "sha256", "tokenizer_sha256"),
    "images": ("what",),
}


def differences(recorded: dict | None, now: dict | None) -> list[str]:
    """How the data `now` differs from the `recorded` (empty: the same samples). A missing record
    (older plans and checkpoints) differs from nothing."""
    if not recorded or not now:
        return []
    if recorded.get("kind") != now.get("kind"):
        return [f"{describe(recorded, brief=True)}, not {describe(now, brief=True)}"]
    keys = _CONTENT.get(str(recorded.get("kind")), ())
    changed = [key for key in keys if recorded.get(key) != now.get(key)]
    if not changed:
        return []
    before, after = describe(recorded, brief=True), describe(now, brief=True)
    if before == after:  # the same file, rewritten in place
        return [f"{before} as it was (its {' and '.join(changed)} changed since)"]
    return [f"{before}, not {after}"]


def describe(record: dict | None, brief: bool = False) -> str:
    """One phrase for headers and errors: what the data is and where it lies (`brief`: without
    what synthetic tokens mean for the loss)."""
    if not record:
        return "the workload's own batches"
    kind = record.get("kind")
    if kind == "synthetic":
        vocab = int(record["vocab"])
        if brief:
            return f"synthetic tokens (ids below {vocab}, seed {record.get('seed')})"
        return (
            f"synthetic tokens (uniform random ids below {vocab}, seed {record.get('seed')}: "
            f"nothing to learn, the loss stays near ln {vocab} = {math.log(vocab):.2f})"
        )
    if kind == "tokens":
        return f"token file {record['path']!r} ({record['dtype']}, {byte_size(record['bytes'])})"
    if kind == "text":
        return f"text {record['path']!r} ({byte_size(record['bytes'])}) tokenized by {record['tokenizer']!r}"
    return str(record.get("what", kind))


def byte_size(count: float, digits: int = 1) -> str:
    """A byte count in the largest binary unit that keeps it at least 1 (1.5 GiB, 80.0 KiB), to
    `digits` decimals."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if count >= scale:
            return f"{count / scale:.{digits}f} {unit}"
    return f"{count:g} B"
