"""What a plan records of its run's inputs — the data (`pipeloom.provenance`), and the compute
type, the device and the torch threads a rank its costs were measured with — so that
`train --plan` trains on them without being told again.

    "inputs": {"data": {...provenance record...} or null, "dtype": "bf16" or null,
               "device": "cpu" or "cuda" or null, "threads": 4 or null}

null: not known when the plan was made (synthetic tokens; the runtime's defaults). The record
is made by the command line (`cli/run_inputs.py`), which may read the data; here it is checked.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pipeloom.errors import ConfigError

__all__ = ["DTYPES", "DEVICES", "RunInputs"]

DTYPES = ("fp32", "bf16", "fp16")
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class RunInputs:
    data: dict[str, Any] | None = None
    """The data's provenance record (`pipeloom.provenance`); None: synthetic tokens."""
    dtype: str | None = None
    device: str | None = None
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, inputs: object, where: str) -> RunInputs:
        """A plan's `inputs` as read from its file, checked: a known data kind, compute type and
        device, and a positive number of threads."""
        if not isinstance(inputs, dict):
            raise ConfigError(f"{where}: field 'inputs' must be an object, got {inputs!r}")
        data, dtype = inputs.get("data"), inputs.get("dtype")
        if data is not None and (not isinstance(data, dict) or data.get("kind") not in ("synthetic", "tokens", "text")):
            raise ConfigError(f"{where}: field 'inputs.data' is not a data record (kind synthetic, tokens or text)")
        if isinstance(data, dict) and data.get("kind") in ("tokens", "text") and not isinstance(data.get("path"), str):
            raise ConfigError(f"{where}: field 'inputs.data' names no file ('path')")
        if dtype is not None and dtype not in DTYPES:
            raise ConfigError(f"{where}: field 'inputs.dtype' must be one of {', '.join(DTYPES)}, got {dtype!r}")
        device, threads = inputs.get("device"), inputs.get("threads")
        if device is not None and device not in DEVICES:
            raise ConfigError(f"{where}: field 'inputs.device' must be one of {', '.join(DEVICES)}, got {device!r}")
        if threads is not None and (type(threads) is not int or threads < 1):
            raise ConfigError(f"{where}: field 'inputs.threads' must be a positive integer, got {threads!r}")
        return cls(data, dtype, device, threads)
