"""Schedule generators, one module per family, all reachable through `build_schedule`."""

from pipeloom.schedules import chimera, classic, dualpipe, svpp, tpipe, v_shape, zero_bubble  # noqa: F401  (registration on import)
from pipeloom.schedules.registry import GeneratorInfo, build_schedule, get_generator, list_generators

__all__ = ["GeneratorInfo", "build_schedule", "get_generator", "list_generators"]
