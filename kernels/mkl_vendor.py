"""Let oneMKL use the vector code paths this CPU has, whoever made it.

torch's CPU build links oneMKL, which serves float32 ``F.linear``/``bmm`` and the blocks of
torch's CPU flash attention. oneMKL takes its generic (pre-AVX2) kernels on any CPU that is not
Intel's. On the project's AMD EPYC (Zen 4) VM that made sgemm 2.3x and prefill SDPA 2-3x slower
than the same calls with its AVX-512 kernels (2026-11-23: sgemm 94 -> 217 GFLOP/s on one
thread; SDPA over 256 causal tokens 1.73 -> 0.85 ms). The environment switches that once
did this (MKL_DEBUG_CPU_TYPE) are gone, and MKL_CBWR / MKL_ENABLE_INSTRUCTIONS measured no change.

The shim in ``csrc/mkl_vendor_shim.c`` answers oneMKL's vendor query. It only takes effect when
loaded into the global symbol scope *before* torch is imported, so importing ``kernels`` calls
:func:`enable_mkl_cpu_dispatch` (the package imports torch only when first used) and ``engine``
imports ``kernels`` first. This module must not import torch.

Set ``PDSERVE_MKL_VENDOR_SHIM=0`` to leave oneMKL alone.
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import sys
from dataclasses import dataclass

SHIM = "mkl_vendor_shim"
# No -fopenmp: linking libgomp here would load the system's copy ahead of torch's own.
SHIM_FLAGS = ("-O2", "-fPIC", "-shared")


@dataclass(frozen=True)
class MklDispatch:
    applied: bool
    reason: str  # why not, when not applied


def cpu_vendor() -> str:
    """/proc/cpuinfo's vendor_id ("AuthenticAMD", "GenuineIntel", ...); "" where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def enable_mkl_cpu_dispatch() -> MklDispatch:
    """Load the vendor-query shim once per process, where it can matter; a no-op elsewhere."""
    if os.environ.get("PDSERVE_MKL_VENDOR_SHIM", "1") == "0":
        return MklDispatch(False, "disabled by PDSERVE_MKL_VENDOR_SHIM=0")
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "AMD64"):
        return MklDispatch(False, f"oneMKL's vendor check is x86-64 only ({platform.machine()})")
    vendor = cpu_vendor()
    if vendor in ("GenuineIntel", ""):
        return MklDispatch(False, f"not needed on this CPU ({vendor or 'vendor unknown'})")
    if "torch" in sys.modules:
        # torch's own definition is already in the global scope, ahead of anything loaded now.
        return MklDispatch(False, "torch was imported first")
    from kernels.cpu_build import load_library  # torch-free

    if load_library(SHIM, SHIM_FLAGS, global_symbols=True) is None:
        return MklDispatch(False, "the shim could not be built (no C compiler?)")
    return MklDispatch(True, "")
