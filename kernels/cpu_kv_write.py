"""Launcher of the compiled CPU K/V write (kernels/csrc/kv_write_cpu.c).

Its plain-torch twin is ``kernels.torch_attention._write_kv`` (an ``index_put_`` per cache).
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import load_kernel
from kernels.cpu_decode import blocks_contiguous
from kernels.input_checks import check_slot_max

_LIB_NAME = "kv_write_cpu"


@functools.cache
def _lib() -> ctypes.CDLL | None:
    lib = load_kernel(_LIB_NAME)
    if lib is not None:
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.write_kv_f32.argtypes = [ptr, i64, ptr, i64, ptr, ptr, i64, ptr, i64, i64, i64,
                                     ctypes.c_int]
        lib.write_kv_f32.restype = None
    return lib


def kv_write_supported(key: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel takes these tensors (float32 on the CPU, contiguous blocks, a
    built library); callers fall back to the torch path otherwise."""
    return (key.device.type == "cpu" and key.dtype == torch.float32
            and k_cache.dtype == torch.float32 and k_cache.dim() == 4
            and blocks_contiguous(k_cache) and _lib() is not None)


def rows_contiguous(t: torch.Tensor) -> bool:
    """Whether each token's [num_kv_heads, head_size] of ``t`` is one contiguous run: the
    kernel copies a token's heads as one. A head dim padded past head_size is not."""
    return t.dim() == 3 and t.stride(2) == 1 and (t.shape[1] == 1 or t.stride(1) == t.shape[2])


def kv_write_takes(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> bool:
    """Whether ``write_kv_cpu`` takes these very tensors; a backend writes through the torch
    path otherwise (it takes any strides)."""
    return (kv_write_supported(key, k_cache) and value.dtype == key.dtype
            and rows_contiguous(key) and rows_contiguous(value)
            and v_cache.dtype == k_cache.dtype and v_cache.stride() == k_cache.stride())


def check_slots(slot_mapping: torch.Tensor, num_blocks: int, block_size: int) -> None:
    """Every slot below num_blocks * block_size (negative ones are skipped, not written)."""
    if slot_mapping.dtype != torch.int64 or slot_mapping.dim() != 1 \
            or not slot_mapping.is_contiguous() or slot_mapping.device.type != "cpu":
        raise ValueError(f"slot_mapping must be a contiguous int64 CPU vector, got "
                         f"{slot_mapping.dtype} {tuple(slot_mapping.shape)} on "
                         f"{slot_mapping.device}")
    if slot_mapping.numel():
        check_slot_max(int(slot_mapping.max()), num_blocks, block_size)


def write_kv_cpu(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 slots_checked: bool = False) -> None:
    """k_cache[slot // block_size, slot % block_size] = key[i] (and the same for V) for every
    token i whose slot_mapping[i] >= 0. key/value: [num_tokens, num_kv_heads, head_size]
    float32 with each token's heads contiguous; caches [num_blocks, block_size, num_kv_heads,
    head_size] with contiguous blocks and equal strides. Slots are range-checked unless the
    caller already did for this very tensor (a backend does it once per step)."""
    _check_tensors(key, value, k_cache, v_cache)
    n, heads, head_size = key.shape
    if slot_mapping.shape != (n,):
        raise ValueError(f"slot_mapping must have one slot per token ({n}), got "
                         f"{tuple(slot_mapping.shape)}")
    if not slots_checked:
        check_slots(slot_mapping, k_cache.shape[0], k_cache.shape[1])
    if n == 0:
        return
    _lib().write_kv_f32(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
                        slot_mapping.data_ptr(), n, heads * head_size, k_cache.shape[1],
                        torch.get_num_threads())


def _check_tensors(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> None:
    if _lib() is None:
        raise ValueError("the CPU K/V write is not available (no working C compiler)")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.dim() != 4 \
                or not blocks_contiguous(t):
            raise ValueError(f"{name} must be a float32 CPU [num_blocks, block_size, "
                             f"num_kv_heads, head_size] tensor with each block contiguous, got "
                             f"{t.dtype} {tuple(t.shape)} strides {t.stride()} on {t.device}")
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must share shape and strides, got "
                         f"{tuple(k_cache.shape)} {k_cache.stride()} and "
                         f"{tuple(v_cache.shape)} {v_cache.stride()}")
    if key.dim() != 3 or value.shape != key.shape or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"key/value must be [num_tokens, {k_cache.shape[2]}, "
                         f"{k_cache.shape[3]}], got key {tuple(key.shape)}, value "
                         f"{tuple(value.shape)}")
    for name, t in (("key", key), ("value", value)):
        if t.dtype != torch.float32 or t.device.type != "cpu" or not rows_contiguous(t):
            raise ValueError(f"{name} must be float32 on the CPU with each token's heads "
                             f"contiguous, got {t.dtype} strides {t.stride()}")
