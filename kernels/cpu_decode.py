"""Launcher of the compiled CPU paged decode kernel (kernels/csrc/paged_decode_cpu.c).

Its plain-torch twin is ``kernels.reference.paged_decode_attention_ref``.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from kernels.cpu_build import load_kernel
from kernels.input_checks import check_block_range

_LIB_NAME = "paged_decode_cpu"
# The kernel keeps on its thread's stack, per query head: an accumulator and the scaled query
# row (head_size each), block_size scores, and its running max, sum and K offset. Counted
# without the two rows and three scalars, the bound let 2x the stack through.
MAX_STACK_FLOATS = 1 << 16


def stack_floats(num_heads: int, head_size: int, block_size: int) -> int:
    """The floats (and same-size ints) the kernel keeps on its stack."""
    return num_heads * (2 * head_size + block_size + 3)


@functools.cache
def _lib() -> ctypes.CDLL | None:
    # Cached: asked twice per layer per step.
    lib = load_kernel(_LIB_NAME)
    if lib is not None:
        i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
        fn = lib.paged_decode_attention_f32
        fn.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, i64, ptr, ptr, i64, i64,
                       i32, i32, i32, i32, i32, ctypes.c_float, i32]
        fn.restype = None
    return lib


def cpu_kernels_available() -> bool:
    """Whether the compiled kernel could be built and loaded on this machine."""
    return _lib() is not None


def blocks_contiguous(cache: torch.Tensor) -> bool:
    """Whether each block of a [num_blocks, block_size, num_kv_heads, head_size] cache is one
    contiguous run (blocks themselves may sit any distance apart: the engine's layer views of
    its block-major cache do)."""
    _, block_size, heads, head_size = cache.shape
    return (cache.stride(3) == 1 and cache.stride(2) == head_size
            and cache.stride(1) == heads * head_size
            and cache.stride(0) >= block_size * heads * head_size)


def supports(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether this kernel handles these tensors (float32 on the CPU, contiguous blocks, each
    query head a contiguous row)."""
    return (query.device.type == "cpu" and query.dtype == torch.float32
            and query.dim() == 3 and query.stride(2) == 1
            and k_cache.dtype == torch.float32 and k_cache.dim() == 4
            and blocks_contiguous(k_cache)
            and stack_floats(query.shape[1], k_cache.shape[3], k_cache.shape[1])
            <= MAX_STACK_FLOATS)


def paged_decode_attention_cpu(query: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float,
                               out: torch.Tensor | None = None,
                               ranges_checked: bool = False) -> torch.Tensor:
    """query [num_seqs, num_heads, head_size] float32 (one token each, the last position of
    its context) over seq_lens [num_seqs] int32 tokens found through block_tables
    [num_seqs, max_num_blocks] int32 in k/v_cache [num_blocks, block_size, num_kv_heads,
    head_size] (each block contiguous; both caches with the same strides). Returns ``out``
    (allocated if None). Lengths and block ids are range-checked (``check_ranges``), since the
    C code would read out of bounds, unless the caller already did for these very tensors (a
    backend does it once per step, not once per layer)."""
    lib = _lib()
    if lib is None:
        raise ValueError("the CPU decode kernel is not available (no working C compiler)")
    _check(query, k_cache, v_cache, block_tables, seq_lens)
    if not ranges_checked:
        check_ranges(block_tables, seq_lens, k_cache.shape[0], k_cache.shape[1])
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} must match query {query.dtype} "
                         f"{tuple(query.shape)} with a contiguous last dim")
    num_seqs, num_heads, head_size = query.shape
    if num_seqs == 0:
        return out
    _, block_size, num_kv_heads, _ = k_cache.shape
    lib.paged_decode_attention_f32(
        query.data_ptr(), query.stride(0), query.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0),
        block_tables.data_ptr(), block_tables.stride(0), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), out.stride(1),
        num_seqs, num_heads, num_kv_heads, head_size, block_size, float(scale),
        torch.get_num_threads())
    return out


def _check(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor) -> None:
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device.type != "cpu" or t.dtype != torch.float32:
            raise ValueError(f"{name} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache and v_cache must both be [num_blocks, block_size, "
                         f"num_kv_heads, head_size], got {tuple(k_cache.shape)} and "
                         f"{tuple(v_cache.shape)}")
    if not blocks_contiguous(k_cache) or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache and v_cache must hold each block contiguously and share "
                         f"strides, got {k_cache.stride()} and {v_cache.stride()}")
    _, _, num_kv_heads, head_size = k_cache.shape
    if query.dim() != 3 or query.shape[2] != head_size or query.stride(2) != 1:
        raise ValueError(f"query must be [num_seqs, num_heads, {head_size}] with a contiguous "
                         f"last dim, got {tuple(query.shape)} strides {query.stride()}")
    num_seqs, num_heads = query.shape[:2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if not supports(query, k_cache):
        raise ValueError("head_size and block_size are too large for the CPU kernel's buffers")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2
            or block_tables.shape[0] != num_seqs or block_tables.stride(1) != 1):
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_num_blocks] with "
                         f"contiguous rows, got {block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (num_seqs,) \
            or not seq_lens.is_contiguous():
        raise ValueError(f"seq_lens must be a contiguous int32 [{num_seqs}], got "
                         f"{seq_lens.dtype} {tuple(seq_lens.shape)}")
    if block_tables.device.type != "cpu" or seq_lens.device.type != "cpu":
        raise ValueError("block_tables and seq_lens must be on the CPU")


def check_ranges(block_tables: torch.Tensor, seq_lens: torch.Tensor, num_blocks: int,
                 block_size: int) -> None:
    """Every seq_len in [1, the table's reach] and every block id in [0, num_blocks)."""
    check_seq_lens(block_tables, seq_lens, block_size)
    if block_tables.numel():
        check_block_range(int(block_tables.min()), int(block_tables.max()), num_blocks)


def check_seq_lens(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int) -> None:
    """Every seq_len in [1, the table's reach]. The kernel reads this tensor, not the host list
    the backends check lengths on, so the tensor itself is checked."""
    if seq_lens.numel() == 0:
        return
    capacity = block_tables.shape[1] * block_size
    lo, hi = int(seq_lens.min()), int(seq_lens.max())
    if lo < 1 or hi > capacity:
        raise ValueError(f"seq_lens must be in [1, {capacity}] (the block tables' reach), "
                         f"got [{lo}, {hi}]")
