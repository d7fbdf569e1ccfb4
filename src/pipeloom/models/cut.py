"""How many layers (or blocks) each stage gets: as the user counted them, or balanced."""

from __future__ import annotations

from collections.abc import Sequence

from pipeloom.errors import ConfigError

__all__ = ["counts_per_stage"]


def counts_per_stage(
    total: int,
    num_stages: int,
    counts: Sequence[int] | None,
    what: str,
    prefix: str = "",
    fix: str = "use fewer stages",
) -> list[int]:
    """`counts` checked against `total`, or a balanced cut (the earlier stages take the remainder)."""
    if counts is not None:
        counts = list(counts)
        if len(counts) != num_stages or any(c < 0 for c in counts) or sum(counts) != total:
            name = "layer" if "layer" in what else "block"
            raise ConfigError(
                f"{prefix}{name} counts {counts} must be {num_stages} non-negative numbers summing to {total}"
            )
        return counts
    if total < num_stages:
        raise ConfigError(f"{prefix}{total} {what} cannot be cut into {num_stages} stages; {fix}")
    base, extra = divmod(total, num_stages)
    return [base + (1 if s < extra else 0) for s in range(num_stages)]
