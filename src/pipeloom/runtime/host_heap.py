"""Keep the memory a CPU step frees in the process, so the next micro-batch does not fault it in again.

glibc hands the top of its heap back to the kernel once more than `M_TRIM_THRESHOLD` lies free
there, and serves blocks above `M_MMAP_THRESHOLD` from mappings of their own that it unmaps on
free; both thresholds start small (128 KiB) and grow only as large blocks come back. A training
step frees and re-allocates the same few hundred MB every micro-batch (activations, logits,
gradients), so with the defaults the kernel zeroes those pages again step after step: on
`bench/real_model.py` (97.5M LLaMA, 2 ranks, 1F1B) pipeloom's steps took 10–90 thousand minor
page faults each — 40–360 MB faulted in, about 3 % of the step — and none once trimming is off.
This is what CUDA's caching allocator does for device memory; the host gets the same by two
`mallopt` calls rather than a second allocator (jemalloc, tcmalloc) that would need preloading.
The process's resident size then stays at its peak, which is the figure the plan budgets anyway.
Elsewhere than glibc the call does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

__all__ = ["keep_freed_memory"]

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_LARGEST_HEAP_BLOCK = 32 << 20
"""glibc's ceiling for M_MMAP_THRESHOLD on 64-bit: larger blocks are always mapped on their own."""


@functools.cache
def keep_freed_memory() -> bool:
    """Stop glibc from returning freed heap to the kernel (once per process); False where the C
    library has no `mallopt`."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # musl, macOS: no such tuning
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # -1 as the trim threshold disables trimming; fixing the mmap threshold keeps blocks up to
    # 32 MiB on the heap, where freed ones are reused instead of unmapped.
    return bool(mallopt(_M_TRIM_THRESHOLD, -1)) and bool(mallopt(_M_MMAP_THRESHOLD, _LARGEST_HEAP_BLOCK))
