"""Keep glibc from returning the engine's per-step activation memory to the OS.

torch takes CPU tensors from ``malloc``. glibc serves large requests with a fresh ``mmap``
and unmaps them on free (its threshold adapts only up to 32 MiB, and the heap top is
trimmed past twice that), so every step's activations were page-faulted and zeroed anew:
measured on this project's 2-core VM, a 2048-token prefill step of ``tiny-llama`` spent
~25% of its time in those faults (GEMM outputs, SiLU*mul). Raising both thresholds lets
freed chunks be reused from the heap. The cost is resident memory: up to
``_TRIM_BYTES`` of freed heap is kept for reuse instead of handed back.

Set ``PDSERVE_HOST_MALLOC_TUNING=0`` to leave the allocator alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys
from dataclasses import dataclass

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations this large still get their own mapping (KV caches, weights loaded whole).
_MMAP_BYTES = 1 << 30
_TRIM_BYTES = 1 << 30


@dataclass(frozen=True)
class MallocTuning:
    applied: bool
    reason: str  # why not, when not applied


@functools.cache
def tune_host_malloc() -> MallocTuning:
    """Raise glibc's mmap and trim thresholds once per process; a no-op elsewhere."""
    if os.environ.get("PDSERVE_HOST_MALLOC_TUNING", "1") == "0":
        return MallocTuning(False, "disabled by PDSERVE_HOST_MALLOC_TUNING=0")
    if not sys.platform.startswith("linux"):
        return MallocTuning(False, f"not glibc ({sys.platform})")
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return MallocTuning(False, "no mallopt in this C library")
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; musl and others may lack it or refuse.
    if mallopt(_M_MMAP_THRESHOLD, _MMAP_BYTES) != 1:
        return MallocTuning(False, "mallopt refused M_MMAP_THRESHOLD")
    if mallopt(_M_TRIM_THRESHOLD, _TRIM_BYTES) != 1:
        return MallocTuning(False, "mallopt refused M_TRIM_THRESHOLD")
    return MallocTuning(True, "")
