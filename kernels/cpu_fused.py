"""Launchers of the compiled element-wise CPU kernels (kernels/csrc/fused_ops_cpu.c).

Each checks what the C code relies on (float32 CPU tensors, rows contiguous in their last
dimension, shapes that agree, positions inside the cos/sin table) and raises ValueError
otherwise. Their plain-torch twins are the layers' own torch paths (engine/layers/norm.py,
engine/layers/rotary.py, engine/layers/activation.py), which run where ``fused_ops_usable`` says no (other
dtypes or devices, no C compiler, ``PDSERVE_DISABLE_CPU_KERNELS=1``).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import load_kernel

_LIB_NAME = "fused_ops_cpu"


@functools.cache
def _lib() -> ctypes.CDLL | None:
    # Cached: every norm and RoPE call asks, several times per layer per step.
    lib = load_kernel(_LIB_NAME)
    if lib is not None:
        i64, i32, ptr, f32 = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p, ctypes.c_float
        lib.rms_norm_f32.argtypes = [ptr, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64,
                                     i64, i64, f32, i32]
        lib.rotary_neox_f32.argtypes = [ptr, ptr, i64, i64, i32, ptr, i64, i64, i32, ptr, i64,
                                        i64, i32]
        lib.silu_and_mul_f32.argtypes = [ptr, i64, ptr, i64, i64, i64, i32]
        for fn in (lib.rms_norm_f32, lib.rotary_neox_f32, lib.silu_and_mul_f32):
            fn.restype = None
    return lib


def fused_ops_usable(x: torch.Tensor) -> bool:
    """Whether the compiled kernels take ``x`` (float32 on the CPU, a built library)."""
    return x.device.type == "cpu" and x.dtype == torch.float32 and _lib() is not None


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    if t.device.type != "cpu" or t.dtype != torch.float32:
        raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.dim() not in (2, 3) or t.shape[-1] != width or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [num_tokens, ({width} | num_heads, {width})] with "
                         f"contiguous rows, got {tuple(t.shape)} strides {t.stride()}")


def _row_strides(t: torch.Tensor) -> tuple[int, int]:
    # A 2-D tensor is [T, 1, hidden] to the kernel.
    return (t.stride(0), t.stride(1) if t.dim() == 3 else 0)


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Every row of x ([num_tokens, hidden] or per head [num_tokens, num_heads, hidden], rows
    contiguous, e.g. heads of a fused qkv row) -> weight * r / rms(r), r = the row (+ its
    residual row, written back into ``residual``). ``out`` (may be ``x``) is allocated when
    None."""
    hidden = weight.shape[0]
    if weight.dim() != 1 or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous [hidden], got {tuple(weight.shape)}")
    _check_rows("x", x, hidden)
    _check_rows("weight", weight.view(1, -1), hidden)
    if residual is not None:
        _check_rows("residual", residual, hidden)
        if residual.shape != x.shape:
            raise ValueError(f"residual {tuple(residual.shape)} must match x {tuple(x.shape)}")
    out = torch.empty(x.shape, dtype=x.dtype) if out is None else out
    _check_rows("out", out, hidden)
    if out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} must match x {tuple(x.shape)}")
    n1 = x.shape[1] if x.dim() == 3 else 1
    res_s = (0, 0) if residual is None else _row_strides(residual)
    _lib().rms_norm_f32(
        x.data_ptr(), *_row_strides(x), 0 if residual is None else residual.data_ptr(), *res_s,
        weight.data_ptr(), out.data_ptr(), *_row_strides(out), x.shape[0], n1, hidden,
        float(eps), torch.get_num_threads())
    return out


def rotary_neox_cpu(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    cos_sin_cache: torch.Tensor, positions_checked: bool = False) -> None:
    """Rotates query [T, num_heads, head_size] and key [T, num_kv_heads, head_size] in place
    (neox style) by the cos_sin_cache [max_position, head_size] rows of positions [T] int64.
    Positions are range-checked (the C code indexes the table with them) unless the caller
    already did for this very tensor: every layer of a step rotates by the same positions,
    and the check's two reductions cost more than the rotation at batch 1."""
    head_size = cos_sin_cache.shape[1]
    _check_rows("cos_sin_cache", cos_sin_cache, head_size)
    if not cos_sin_cache.is_contiguous() or head_size % 2:
        raise ValueError("cos_sin_cache must be contiguous with an even head_size")
    if positions.dtype != torch.int64 or positions.dim() != 1 or not positions.is_contiguous():
        raise ValueError(f"positions must be a contiguous int64 [T], got {positions.dtype} "
                         f"{tuple(positions.shape)}")
    num_tokens = positions.shape[0]
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 3 or t.shape[0] != num_tokens or t.shape[2] != head_size:
            raise ValueError(f"{name} must be [{num_tokens}, num_heads, {head_size}], got "
                             f"{tuple(t.shape)}")
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(2) != 1:
            raise ValueError(f"{name} must be float32 on the CPU with contiguous head rows")
    if num_tokens == 0:
        return
    if not positions_checked:
        lo, hi = int(positions.min()), int(positions.max())
        if lo < 0 or hi >= cos_sin_cache.shape[0]:
            raise ValueError(f"positions must be in [0, {cos_sin_cache.shape[0]}), "
                             f"got [{lo}, {hi}]")
    _lib().rotary_neox_f32(
        positions.data_ptr(), query.data_ptr(), query.stride(0), query.stride(1), query.shape[1],
        key.data_ptr(), key.stride(0), key.stride(1), key.shape[1], cos_sin_cache.data_ptr(),
        head_size, num_tokens, torch.get_num_threads())


def silu_and_mul_cpu(x: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, 2 * d] (gate then up, rows contiguous) -> silu(gate) * up [num_tokens, d]."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [num_tokens, 2 * d], got {tuple(x.shape)}")
    _check_rows("x", x, x.shape[1])
    d = x.shape[1] // 2
    out = torch.empty(x.shape[0], d, dtype=x.dtype)
    if x.shape[0]:
        _lib().silu_and_mul_f32(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                x.shape[0], d, torch.get_num_threads())
    return out
