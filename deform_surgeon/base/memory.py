"""Giving freed memory back to the system, for the work that allocates and frees hundreds of MB at a time (the local
proofs' runs, `verify`'s segments).

Why: glibc keeps freed pieces below its mmap threshold in the process's heap, and so in its RSS, unless the heap is
trimmed; elsewhere (no glibc) there is nothing to trim. The C library is looked up at the first call (finding it may
start a process), not when the module is imported."""

from __future__ import annotations

import functools


@functools.cache
def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        return libc
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None


def release() -> None:
    """Give the memory freed so far back to the system (glibc's malloc_trim; elsewhere nothing)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
