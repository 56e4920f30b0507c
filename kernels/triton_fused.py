"""Triton kernels for the element-wise work around the GEMMs on CUDA: RMSNorm (with the residual
add before it), SiLU-and-mul, and neox rotary embedding, each one launch.

Unfused, these ops cost a decode step of a 28-layer model ~1,500 small kernels (casts, powers,
means, adds: docs/benchmarks.md, session 27), which took most of a batch-1 step's device time
on an H200. Each kernel rounds to the model dtype where the plain-torch path (the layers'
``_norm``/``forward_torch``, the references the tests compare against) rounds, so bfloat16
results match that path up to float32 summation order in the norm's mean.

Launchers check shapes, strides, dtypes and devices and raise ValueError; they never read
tensor values on the host, so they can be captured in CUDA graphs.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.triton_cache import DTYPES, check_launchable


def triton_fused_usable(x: torch.Tensor) -> bool:
    """Whether the layers take these kernels for ``x``: CUDA tensors of a kernel dtype, unless
    ``PDSERVE_DISABLE_TRITON_FUSED=1`` (then the plain-torch ops run)."""
    return (x.is_cuda and x.dtype in DTYPES
            and os.environ.get("PDSERVE_DISABLE_TRITON_FUSED", "0") != "1")


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr,  # rows of x / residual / out: [num_tokens, num_heads, width]
    stride_xt, stride_xh, stride_rt, stride_rh, stride_ot, stride_oh,
    num_heads, width, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    t = (row // num_heads).to(tl.int64)
    h = row % num_heads
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r_ptrs = res_ptr + t * stride_rt + h * stride_rh + cols
        r = tl.load(r_ptrs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)  # the add rounds, as torch's does
        tl.store(r_ptrs, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / width
    normed = (xf * tl.rsqrt(var + eps)).to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + cols, (normed * w).to(dt), mask=mask)


def _as_rows(name: str, t: torch.Tensor, width: int) -> tuple[int, int]:
    """(stride per token, stride per head) of a [T, width] or [T, heads, width] tensor."""
    if t.dim() not in (2, 3) or t.shape[-1] != width or t.stride(-1) != 1:
        raise ValueError(f"{name} must be [num_tokens, ({width} | num_heads, {width})] with "
                         f"contiguous rows, got {tuple(t.shape)} strides {t.stride()}")
    return t.stride(0), (t.stride(1) if t.dim() == 3 else 0)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Each row r of x ([T, hidden] or per head [T, heads, head_size]) -> weight * r / rms(r);
    with ``residual``, r = x + residual first, written back into ``residual``. ``out`` may be
    ``x`` (in place); allocated when None."""
    width = x.shape[-1]
    if weight.shape != (width,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous [{width}], got {tuple(weight.shape)}")
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and "
                         f"{weight.dtype}")
    out = torch.empty_like(x) if out is None else out
    tensors = [x, weight, out] + ([residual] if residual is not None else [])
    check_launchable(_rms_norm_kernel, *tensors)
    sxt, sxh = _as_rows("x", x, width)
    sot, soh = _as_rows("out", out, width)
    srt, srh = sxt, sxh
    for name, t in (("out", out),) + ((("residual", residual),) if residual is not None else ()):
        if t.shape != x.shape or t.dtype != x.dtype:
            raise ValueError(f"{name} must match x ({tuple(x.shape)}, {x.dtype}), got "
                             f"{tuple(t.shape)}, {t.dtype}")
    if residual is not None:
        srt, srh = _as_rows("residual", residual, width)
    heads = x.shape[1] if x.dim() == 3 else 1
    if x.shape[0] * heads:
        _rms_norm_kernel[(x.shape[0] * heads,)](
            x, residual if residual is not None else x, weight, out,
            sxt, sxh, srt, srh, sot, soh, heads, width, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(width))
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, stride_ot, d, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    dt = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * stride_xt + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * stride_xt + d + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)  # F.silu rounds, then the mul
    tl.store(out_ptr + t * stride_ot + cols, (act * up).to(dt), mask=mask)


_SILU_BLOCK = 1024


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """[T, 2 * d] (gate then up) -> [T, d] = silu(gate) * up."""
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * d] with contiguous rows, got "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if x.dtype not in DTYPES:
        raise ValueError(f"x must be one of {DTYPES}, got {x.dtype}")
    check_launchable(_silu_and_mul_kernel, x)
    d = x.shape[1] // 2
    out = torch.empty((x.shape[0], d), dtype=x.dtype, device=x.device)
    if x.shape[0] and d:
        _silu_and_mul_kernel[(x.shape[0], triton.cdiv(d, _SILU_BLOCK))](
            x, out, x.stride(0), out.stride(0), d, BLOCK=_SILU_BLOCK)
    return out


@triton.jit
def _rotate_heads(ptr, stride_h, num_heads, cos, sin, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    # ptr: this token's first head; cos, sin: [HALF] float32, already rounded to the dtype.
    dt = ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    lo = ptr + heads * stride_h + dims  # [BLOCK_H, HALF]
    x1 = tl.load(lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0).to(tl.float32)
    # Every product and sum rounds to the dtype, as the torch path's bf16 ops do.
    a = (x1 * cos[None, :]).to(dt).to(tl.float32)
    b = (x2 * sin[None, :]).to(dt).to(tl.float32)
    c = (x2 * cos[None, :]).to(dt).to(tl.float32)
    e = (x1 * sin[None, :]).to(dt).to(tl.float32)
    tl.store(lo, (a - b).to(dt), mask=mask)
    tl.store(lo + HALF, (c + e).to(dt), mask=mask)


@triton.jit
def _rotary_neox_kernel(
    pos_ptr, q_ptr, k_ptr, cache_ptr,  # [T]; [T, q_heads, 2 * HALF]; [T, k_heads, ...]; [P, 2 * HALF]
    stride_qt, stride_qh, stride_kt, stride_kh, stride_cp,
    num_q_heads, num_k_heads,
    HALF: tl.constexpr, BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    dt = q_ptr.dtype.element_ty
    dims = tl.arange(0, HALF)
    cos = tl.load(cache_ptr + pos * stride_cp + dims).to(dt).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_cp + HALF + dims).to(dt).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_q_heads, cos, sin, HALF, BLOCK_H)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_k_heads, cos, sin, HALF, BLOCK_H)


def rotary_neox_triton(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                       cos_sin_cache: torch.Tensor) -> None:
    """Rotates query [T, q_heads, head_size] and key [T, k_heads, head_size] in place by
    cos_sin_cache [max_position, head_size] (cos halves then sin halves, float32) at
    ``positions`` [T]. Positions are not range-checked here (that would read them on the host
    and break graph capture): the engine's are in range by construction."""
    if query.dim() != 3 or key.dim() != 3 or positions.dim() != 1:
        raise ValueError("query and key must be [num_tokens, num_heads, head_size], positions "
                         f"[num_tokens]; got {tuple(query.shape)}, {tuple(key.shape)}, "
                         f"{tuple(positions.shape)}")
    head_size = query.shape[2]
    if (key.shape[0], key.shape[2]) != (query.shape[0], head_size) \
            or positions.shape[0] != query.shape[0]:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)} and positions "
                         f"{tuple(positions.shape)} disagree")
    if head_size < 2 or head_size & (head_size - 1):
        raise ValueError(f"head_size must be a power of two, got {head_size}")
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != head_size \
            or cos_sin_cache.stride(1) != 1 or cos_sin_cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache must be float32 [max_position, {head_size}] with "
                         f"contiguous rows, got {cos_sin_cache.dtype} "
                         f"{tuple(cos_sin_cache.shape)}")
    if query.stride(2) != 1 or key.stride(2) != 1 or query.dtype != key.dtype \
            or query.dtype not in DTYPES:
        raise ValueError("query and key must share a dtype of the kernels' and be contiguous "
                         "in their last dimension")
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"positions must be int32 or int64, got {positions.dtype}")
    check_launchable(_rotary_neox_kernel, positions, query, key, cos_sin_cache)
    if query.shape[0]:
        _rotary_neox_kernel[(query.shape[0],)](
            positions, query, key, cos_sin_cache, query.stride(0), query.stride(1),
            key.stride(0), key.stride(1), cos_sin_cache.stride(0), query.shape[1], key.shape[1],
            HALF=head_size // 2,
            BLOCK_H=triton.next_power_of_2(max(query.shape[1], key.shape[1])))
