"""Triton kernel that writes a step's new K/V rows into the paged caches, and the launch-time
checks the Triton kernels share (devices, dtypes, the paged-cache layout).

Cache layout per layer: k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_size];
token t goes to slot = block_id * block_size + offset; a negative slot (padding) is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from kernels import triton_supports_head_size
from kernels.torch_attention import write_kv_by_slots

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr,  # [num_tokens, num_kv_heads, head_size]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    slot_mapping_ptr,  # [num_tokens]
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_co, stride_ch,  # k_cache and v_cache share strides (checked)
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
):
    token = tl.program_id(0)
    # int64: block_id * stride_cb overflows int32 on caches of a few GiB.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, HEAD_SIZE)
    # A negative slot masks every head out (no branch needed).
    live_heads = tl.where(slot >= 0, num_kv_heads, 0)
    mask = heads[:, None] < live_heads  # [BLOCK_H, 1]
    src_k = key_ptr + token.to(tl.int64) * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_v = value_ptr + token.to(tl.int64) * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = ((slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_co
           + heads[:, None] * stride_ch + dims[None, :])  # [BLOCK_H, HEAD_SIZE]
    tl.store(k_cache_ptr + dst, tl.load(src_k, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_v, mask=mask), mask=mask)


def dot_dtype(kernel, dtype: torch.dtype) -> tl.dtype:
    """The dtype ``kernel`` feeds tl.dot for ``dtype`` inputs: the input dtype itself, except
    bfloat16 under the interpreter, whose tl.dot multiplies bfloat16's raw uint16 bits
    (triton-lang/triton#11584, unsupported there), so those operands go in as float32."""
    if dtype == torch.bfloat16:
        return tl.float32 if isinstance(kernel, InterpretedFunction) else tl.bfloat16
    return tl.float16 if dtype == torch.float16 else tl.float32


def check_launchable(kernel, *tensors: torch.Tensor) -> None:
    """All tensors on one device that ``kernel`` can run on."""
    device = tensors[0].device
    for t in tensors[1:]:
        if t.device != device:
            raise ValueError(f"all tensors must be on one device, got {device} and {t.device}")
    if device.type == "cpu":
        # The interpreter is chosen when the kernel is decorated, i.e. at import time.
        if not isinstance(kernel, InterpretedFunction):
            raise ValueError("Triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                             "the kernels.triton_* modules are first imported")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides "
                             f"{tuple(t.stride())}")


def check_head_size(head_size: int) -> None:
    if not triton_supports_head_size(head_size):
        raise ValueError(f"head_size must be a power of two >= 16, got {head_size}")


def check_kv_caches(k_cache: torch.Tensor, v_cache: torch.Tensor,
                    dtype: torch.dtype | None = None) -> tuple[int, int, int, int]:
    """Checks the paged caches; returns (num_blocks, block_size, num_kv_heads, head_size)."""
    if k_cache.dim() != 4:
        raise ValueError("k_cache must be [num_blocks, block_size, num_kv_heads, head_size], "
                         f"got shape {tuple(k_cache.shape)}")
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} != k_cache shape "
                         f"{tuple(k_cache.shape)}")
    if v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and "
                         f"{v_cache.stride()}")
    if k_cache.dtype not in DTYPES or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"k_cache and v_cache must both be one of {DTYPES}, got "
                         f"{k_cache.dtype} and {v_cache.dtype}")
    if dtype is not None and k_cache.dtype != dtype:
        raise ValueError(f"the caches are {k_cache.dtype} but the inputs are {dtype}")
    check_last_dim_contiguous(k_cache=k_cache, v_cache=v_cache)
    check_head_size(k_cache.shape[3])
    return tuple(k_cache.shape)


def check_int_vector(name: str, t: torch.Tensor, length: int,
                     dtypes: tuple[torch.dtype, ...] = (torch.int32,)) -> None:
    if t.dim() != 1 or t.shape[0] != length:
        raise ValueError(f"{name} must have shape [{length}], got {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} must be one of {dtypes}, got {t.dtype}")
    check_last_dim_contiguous(**{name: t})


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Writes key/value [num_tokens, num_kv_heads, head_size] into the caches at slot_mapping
    [num_tokens] (int32 or int64; negative slots are skipped). Slots are not range-checked:
    that would need a device sync."""
    _, block_size, num_kv_heads, head_size = check_kv_caches(k_cache, v_cache, key.dtype)
    if key.dim() != 3 or key.shape[1:] != (num_kv_heads, head_size):
        raise ValueError(f"key must be [num_tokens, {num_kv_heads}, {head_size}], got "
                         f"{tuple(key.shape)}")
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {tuple(value.shape)} {value.dtype} must match key "
                         f"{tuple(key.shape)} {key.dtype}")
    check_int_vector("slot_mapping", slot_mapping, key.shape[0], (torch.int32, torch.int64))
    check_last_dim_contiguous(key=key, value=value)
    check_launchable(_reshape_and_cache_kernel, key, value, k_cache, v_cache, slot_mapping)
    if key.shape[0] == 0:
        return
    _reshape_and_cache_kernel[(key.shape[0],)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_kv_heads,
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size, BLOCK_H=triton.next_power_of_2(num_kv_heads),
    )


def reshape_and_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Plain-torch twin of ``reshape_and_cache``: the torch backend's own cache write."""
    write_kv_by_slots(key, value, k_cache, v_cache, slot_mapping)
