"""Schedule generators, one module per family, all reachable through `build_schedule`."""

# Registration on import, in the order the tuner prefers its schemes on a tie.
from pipeloom.schedules import classic, chimera, zero_bubble, v_shape, tpipe, svpp, dualpipe, forward_only  # noqa: F401, I001
from pipeloom.schedules.registry import GeneratorInfo, build_schedule, get_generator, list_generators

__all__ = ["GeneratorInfo", "build_schedule", "get_generator", "list_generators"]
