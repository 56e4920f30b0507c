"""Linear layers on oneMKL's packed sgemm: the weight packed once, each call only computes.

torch's CPU build carries oneMKL inside ``libtorch_cpu`` and exports its CBLAS symbols, among
them ``cblas_sgemm_pack`` and ``cblas_sgemm_compute``. A plain sgemm (what ``F.linear`` runs)
re-packs the whole weight on every call, which dominates at decode batch sizes; packing it at
load time leaves only the multiply. On the 2-core AVX2 EPYC VM, with oneMKL on its AVX2 kernels
(kernels/mkl_vendor.py), this runs a decoder layer's GEMMs 1.3-1.6x faster than oneDNN's packed
GEMM at 4-64 rows and 1.3x at 512; on other CPUs oneDNN may win, which is why the engine times
both before it picks (engine/linear_tuning.py).

float32 only. The plain-torch twin is ``F.linear(x, weight, bias)``, which the tests compare
against.
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels.huge_pages import huge_page_empty

# CBLAS enumerations (mkl_cblas.h).
_ROW_MAJOR = 101
_NO_TRANS, _TRANS = 111, 112
_PACKED = 151
_B_MATRIX = 162
# oneMKL's pack layout does not depend on the row count it is given; this is only its hint.
_PACK_ROWS_HINT = 64


@functools.cache
def _lib() -> ctypes.CDLL | None:
    path = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        lib = ctypes.CDLL(str(path))
        get_size, pack, compute = (lib.cblas_sgemm_pack_get_size, lib.cblas_sgemm_pack,
                                   lib.cblas_sgemm_compute)
    except (OSError, AttributeError):  # another platform, or a torch built without oneMKL
        return None
    i32, ptr, f32 = ctypes.c_int, ctypes.c_void_p, ctypes.c_float
    get_size.argtypes = [i32, i32, i32, i32]
    get_size.restype = ctypes.c_size_t
    pack.argtypes = [i32, i32, i32, i32, i32, i32, f32, ptr, i32, ptr]
    pack.restype = None
    compute.argtypes = [i32, i32, i32, i32, i32, i32, ptr, i32, ptr, i32, f32, ptr, i32]
    compute.restype = None
    return lib


def mkl_compute_address() -> int | None:
    """The address of oneMKL's ``cblas_sgemm_compute`` (for compiled callers that chain it
    with other kernels: kernels/csrc/decode_graph_cpu.c), None without oneMKL."""
    lib = _lib()
    return None if lib is None else ctypes.cast(lib.cblas_sgemm_compute, ctypes.c_void_p).value


@functools.cache
def mkl_available() -> bool:
    """Whether oneMKL's packed sgemm is there and computes F.linear (probed once)."""
    if _lib() is None:
        return False
    # A private generator for all three: a draw from the global one, at the first engine's
    # start in a process, moved --seed's state (that engine's unseeded samples differed).
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(37, 19, generator=g), torch.randn(5, 19, generator=g)
    b = torch.randn(37, generator=g)
    try:
        got = mkl_packed_linear(x, mkl_pack_weight(w), 37, 19, b)
    except (RuntimeError, ValueError):
        return False
    return bool(torch.allclose(got, F.linear(x, w, b), atol=1e-5))


def mkl_pack_weight(weight: torch.Tensor, threads: int | None = None,
                    huge_pages: bool = True) -> torch.Tensor:
    """``weight`` [out_features, in_features] float32 in oneMKL's packed layout (bytes), split
    for ``threads`` (default: torch's current count). The split is fixed: a weight packed for
    one thread runs single-threaded even when more are allowed (measured: 6.1 ms for
    tiny-llama's layers at 1 row, 3.5 ms packed for two threads); one packed for two runs on
    one thread 4-12% slower than one packed for one. ``huge_pages``: in huge-page memory
    (kernels/huge_pages.py) where the kernel has it; False: torch's allocator. A pack cannot be
    copied elsewhere (oneMKL faults computing from a copy), so the memory is chosen here."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"oneMKL packs a 2-D float32 CPU weight, got {weight.dtype} "
                         f"{tuple(weight.shape)} on {weight.device}")
    lib = _lib()
    if lib is None:
        raise ValueError("oneMKL's packed sgemm is not available in this torch build")
    n, k = weight.shape
    weight = weight.contiguous()
    previous = torch.get_num_threads()
    if threads is not None and threads != previous:
        if threads < 1:
            raise ValueError(f"threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)
    try:
        # Sized under the thread count it is packed for: the layout is split per thread, so
        # a size taken under another count could be short of what the pack writes.
        size = lib.cblas_sgemm_pack_get_size(_B_MATRIX, _PACK_ROWS_HINT, n, k)
        # Read whole every step: in huge pages (kernels/huge_pages.py), 2 MiB-aligned (oneMKL
        # wants 64 bytes; torch's own allocations, the fallback, are 64-byte aligned too).
        packed = huge_page_empty(size) if huge_pages else torch.empty(size, dtype=torch.uint8)
        # B = W^T: the weight read transposed, leading dimension in_features.
        lib.cblas_sgemm_pack(_ROW_MAJOR, _B_MATRIX, _TRANS, _PACK_ROWS_HINT, n, k, 1.0,
                             weight.data_ptr(), k, packed.data_ptr())
    finally:
        if torch.get_num_threads() != previous:
            torch.set_num_threads(previous)
    return packed


def mkl_packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                      in_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [num_tokens, in_features] @ W^T (+ bias) -> [num_tokens, out_features]."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"the oneMKL linear takes a 2-D float32 CPU input, got {x.dtype} "
                         f"{tuple(x.shape)} on {x.device}")
    if x.shape[1] != in_features:
        raise ValueError(f"input has {x.shape[1]} features, the weight takes {in_features}")
    if packed.dtype != torch.uint8 or packed.dim() != 1:
        raise ValueError("packed must be the byte buffer mkl_pack_weight returned")
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (out_features,)):
        raise ValueError(f"bias must be float32 [{out_features}], got {bias.dtype} "
                         f"{tuple(bias.shape)}")
    m = x.shape[0]
    out = torch.empty(m, out_features, dtype=torch.float32)
    if bias is not None:
        out.copy_(bias)  # the GEMM adds onto it (beta 1)
    if m == 0 or out_features == 0:
        return out
    # oneMKL refuses a leading dimension under the row length and then computes nothing:
    # rows that overlap (an expanded input) are copied; a single row's stride is any torch
    # calls contiguous ([1, k] taken from a transpose has stride (1, 1)), and means nothing.
    if x.stride(1) != 1 or (m > 1 and x.stride(0) < in_features):
        x = x.contiguous()
    lda = max(x.stride(0), in_features, 1)
    _lib().cblas_sgemm_compute(_ROW_MAJOR, _NO_TRANS, _PACKED, m, out_features, in_features,
                               x.data_ptr(), lda, packed.data_ptr(), in_features,
                               1.0 if bias is not None else 0.0, out.data_ptr(), out_features)
    return out
