"""Launcher of the few-rows float32 linear kernel (kernels/csrc/small_linear_cpu.c).

Decode at low batch multiplies 1-8 rows by every weight: the step streams the model's weights
through memory, and oneDNN's packed GEMM (and MKL's plain sgemm) reach a third to a half of the streaming
bandwidth there. Layers that keep their plain weight next to the packed one send such calls
here. The plain-torch twin is ``F.linear(x, weight, bias)``, which the tests compare against.
"""
from __future__ import annotations

import ctypes
import functools
import os

import torch

from kernels.cpu_build import load_kernel

_LIB_NAME = "small_linear_cpu"
# Rows up to which the kernel runs (its register blocking has one accumulator per row).
SMALL_LINEAR_MAX_ROWS = 8


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_kernel(_LIB_NAME)
    if lib is not None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        lib.small_linear_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, i32, i64, i64, i32]
        lib.small_linear_f32.restype = None
    return lib


def small_linear_usable(weight: torch.Tensor) -> bool:
    """Whether layers with this weight may use the kernel (float32 CPU, a built library).
    ``PDSERVE_SMALL_LINEAR=0`` says no: packed layers then free their plain weights, which
    halves their memory and leaves low-batch decode to oneDNN."""
    return (os.environ.get("PDSERVE_SMALL_LINEAR") != "0" and weight.device.type == "cpu"
            and weight.dtype == torch.float32 and _lib() is not None)


def small_linear(x: torch.Tensor, weight: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] (m <= SMALL_LINEAR_MAX_ROWS) @ weight [n, k]^T (+ bias [n]) -> [m, n]."""
    lib = _lib()
    if lib is None:
        raise ValueError("the small-linear CPU kernel is not available (no working C compiler)")
    for name, t in (("x", x), ("weight", weight), ("bias", bias)):
        if t is not None and (t.device.type != "cpu" or t.dtype != torch.float32):
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [m, k] and weight [n, k] must agree, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    m, k = x.shape
    n = weight.shape[0]
    if not 0 <= m <= SMALL_LINEAR_MAX_ROWS:
        raise ValueError(f"x has {m} rows; the kernel takes at most {SMALL_LINEAR_MAX_ROWS}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != n or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        raise ValueError(f"weight rows must be contiguous, got strides {weight.stride()}")
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        lib.small_linear_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), weight.stride(0),
                             bias.data_ptr() if bias is not None else None, out.data_ptr(),
                             out.stride(0), m, n, k, torch.get_num_threads())
    return out
