"""Importing transformers and torchvision next to a CPU-only torch.

The torchvision wheels on PyPI are built against CUDA torch: next to the CPU build of the same
torch their C++ operators cannot load, and torchvision 0.28's own import then fails registering a
fake kernel for `torchvision::nms` (its only unguarded registration, with `qnms`) — which also
breaks `transformers`, since it imports torchvision when installed. The models pipeloom uses
(ResNets, and no detection ops) are pure Python, so when the operators are missing we declare
those two schemas and let the import go on; with a working torchvision nothing is touched.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from pipeloom.errors import ConfigError

__all__ = ["import_transformers", "import_torchvision"]

_declared: torch.library.Library | bool | None = None


def _declare_missing_torchvision_ops() -> None:
    global _declared
    if _declared is not None or importlib.util.find_spec("torchvision") is None:
        return
    import torch

    spec = importlib.util.find_spec("torchvision")
    origin = spec.origin if spec is not None else None
    library = next(Path(origin).parent.glob("_C*.so"), None) if origin else None
    if library is not None:
        try:
            torch.ops.load_library(str(library))
        except (OSError, RuntimeError):
            pass
    if hasattr(torch.ops.torchvision, "nms"):
        _declared = False
        return
    library_ops = torch.library.Library("torchvision", "DEF")
    library_ops.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    library_ops.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _declared = library_ops


def import_transformers():
    _declare_missing_torchvision_ops()
    try:
        import transformers
    except ImportError:
        raise ConfigError("hf: models need transformers: pip install 'pipeloom[models]'") from None
    transformers.logging.set_verbosity_error()
    return transformers


def import_torchvision():
    _declare_missing_torchvision_ops()
    try:
        import torchvision
    except ImportError:
        raise ConfigError("vision: torchvision models need torchvision: pip install 'pipeloom[vision]'") from None
    return torchvision
