"""Schedule generators, one module per family, all reachable through `build_schedule`."""

# Registration on import, in the order the tuner prefers its schemes on a tie.
from pipeloom.schedules import classic, chimera, zero_bubble, v_shape, tpipe, svpp, dualpipe, forward_only  # noqa: F401, I001
from pipeloom.schedules.registry import GeneratorInfo, build_schedule, get_generator, list_generators

__all__ = ["GeneratorInfo", "build_schedule", "clear_caches", "get_generator", "list_generators"]


def clear_caches() -> None:
    """Forget what the budgeted generators keep between calls (the schedules found per input,
    the V greedy's runs, the authors' V orders): for timing a build as a fresh process would
    make it, or to free memory after many large inputs."""
    from pipeloom.schedules import budget_ladder, v_authors_blocks, v_search

    budget_ladder.forget()
    v_search.forget()
    v_authors_blocks.forget()
