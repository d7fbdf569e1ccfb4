"""A CPU rank keeps the heap its steps free: the same allocations again take no page faults."""

import ctypes.util
import platform
import resource

import pytest

from pipeloom.runtime.host_heap import keep_freed_memory

glibc = pytest.mark.skipif(
    platform.libc_ver()[0] != "glibc" or ctypes.util.find_library("c") is None, reason="mallopt is glibc's"
)


@glibc
def test_freed_blocks_are_reused_without_faulting_them_in_again():
    assert keep_freed_memory()

    def one_step() -> int:
        """What a step does to the heap: activations of several sizes under 32 MiB, all freed."""
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        blocks = [bytearray(size << 20) for size in (5, 9, 3, 17, 6)]  # zero-filled: every page touched
        del blocks
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    one_step()  # the heap grows to the step's peak once
    # glibc's defaults give the 40 MiB back after each step and fault ~10,000 pages in again
    assert max(one_step() for _ in range(3)) < 500
