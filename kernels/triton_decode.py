"""Paged decode attention in Triton: one query token per sequence over its paged context.

Split-K ("flash decoding"): a long context is cut into partitions of ``partition_size`` tokens,
each attended by its own program so a small batch still fills the GPU; a second kernel merges
the partitions' softmax maxima and sums. When every context fits one partition the first
kernel writes the output directly and the reduce is skipped.

GQA: one program serves all query heads that share a KV head, so each K/V tile is read once
for the whole group.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import paged_decode_attention_ref  # noqa: F401 - the kernel's twin
from kernels.triton_cache import (check_int_vector, check_kv_caches, check_last_dim_contiguous,
                                  check_launchable, dot_dtype)

DEFAULT_PARTITION_SIZE = 512
# tl.dot wants every dimension >= 16 on tensor-core GPUs; the padded query rows are masked.
_MIN_GROUP_BLOCK = 16
# The reduce kernel's partition tile: 16 x 512 tokens covers contexts up to 8192 in one variant.
_MIN_REDUCE_BLOCK = 16
_LOG2E = 1.4426950408889634


# Nothing that follows the batch compiles a variant of its own (see kernels/triton_prefill.py):
# the partition count is a plain argument, not a constexpr, since outside CUDA graphs it grows
# with the longest context; the table's row stride likewise.
@triton.jit(do_not_specialize=["stride_bts", "num_partitions"])
def _decode_partition_kernel(
    q_ptr,  # [num_seqs, num_heads, head_size]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_seqs, num_heads, head_size]: written when num_partitions == 1
    part_out_ptr,  # [num_seqs, num_heads, num_partitions, head_size] float32
    part_max_ptr, part_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qs, stride_qh, stride_os, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bts,
    num_partitions,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    PARTITION_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    part_start = part * PARTITION_SIZE
    # The grid covers the longest context; shorter ones leave their tail programs idle.
    if part_start < seq_len:
        part_end = tl.minimum(part_start + PARTITION_SIZE, seq_len)
        groups = tl.arange(0, BLOCK_G)
        dims = tl.arange(0, HEAD_SIZE)
        heads = kv_head * GROUP + groups  # query heads of this KV head
        g_mask = groups < GROUP
        q_off = seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + dims[None, :]
        q = tl.load(q_ptr + q_off, mask=g_mask[:, None], other=0.0)  # [BLOCK_G, HEAD_SIZE]
        q = q.to(DOT_DTYPE)
        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_SIZE], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bts
        # Every tile starts below seq_len, so each holds a visible token and m_i stays finite.
        for tile in range(part_start, part_end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            n_mask = pos < part_end
            block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            rows = (block * stride_cb + (pos % BLOCK_SIZE) * stride_co
                    + kv_head * stride_ch)  # [BLOCK_N]
            kv_off = rows[:, None] + dims[None, :]  # [BLOCK_N, HEAD_SIZE]
            k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
            s = s * qk_scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                               input_precision="ieee")
            m_i = m_new
        if num_partitions == 1:
            o = out_ptr + seq.to(tl.int64) * stride_os + heads[:, None] * stride_oh + dims[None, :]
            tl.store(o, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
        else:
            # Partition stats row of (seq, head): ((seq * num_heads + head) * num_partitions).
            stat = ((seq * tl.num_programs(1) * GROUP + heads).to(tl.int64) * num_partitions
                    + part)  # [BLOCK_G]
            tl.store(part_max_ptr + stat, m_i, mask=g_mask)
            tl.store(part_sum_ptr + stat, l_i, mask=g_mask)
            tl.store(part_out_ptr + stat[:, None] * HEAD_SIZE + dims[None, :],
                     acc / l_i[:, None], mask=g_mask[:, None])


@triton.jit(do_not_specialize=["num_partitions"])
def _decode_reduce_kernel(
    out_ptr,  # [num_seqs, num_heads, head_size]
    part_out_ptr,  # [num_seqs, num_heads, num_partitions, head_size] float32
    part_max_ptr, part_sum_ptr,  # [num_seqs, num_heads, num_partitions] float32 (base 2)
    seq_lens_ptr,  # [num_seqs]
    stride_os, stride_oh,
    num_partitions,
    HEAD_SIZE: tl.constexpr, PARTITION_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    num_parts = tl.cdiv(seq_len, PARTITION_SIZE)  # only these were written
    parts = tl.arange(0, BLOCK_P)
    p_mask = parts < num_parts
    row = (seq * tl.num_programs(1) + head).to(tl.int64) * num_partitions
    m = tl.load(part_max_ptr + row + parts, mask=p_mask, other=float("-inf"))  # [BLOCK_P]
    l = tl.load(part_sum_ptr + row + parts, mask=p_mask, other=0.0)
    # Each partition's output is already normalized by its own sum; reweight by its share
    # of the global softmax mass.
    w = tl.where(p_mask, l * tl.exp2(m - tl.max(m, 0)), 0.0)  # [BLOCK_P]
    dims = tl.arange(0, HEAD_SIZE)
    part_out = tl.load(part_out_ptr + (row + parts[:, None]) * HEAD_SIZE + dims[None, :],
                       mask=p_mask[:, None], other=0.0)  # [BLOCK_P, HEAD_SIZE]
    o = tl.sum(part_out * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_os + head * stride_oh + dims,
             o.to(out_ptr.dtype.element_ty))


def paged_decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           out: torch.Tensor | None = None,
                           partition_size: int = DEFAULT_PARTITION_SIZE,
                           max_seq_len: int | None = None) -> torch.Tensor:
    """Attention of query [num_seqs, num_heads, head_size] (one token per sequence, the last
    position of its context) over seq_lens [num_seqs] int32 tokens reached through
    block_tables [num_seqs, max_num_blocks] int32. ``max_seq_len`` (host int) sizes the grid
    and must be >= every seq_len (longer contexts would lose their tail partitions); None uses
    the block tables' width, which never depends on the data (CUDA graphs).
    Returns ``out`` (allocated if None), [num_seqs, num_heads, head_size]."""
    _, block_size, num_kv_heads, head_size = check_kv_caches(k_cache, v_cache, query.dtype)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [num_seqs, num_heads, {head_size}], got "
                         f"{tuple(query.shape)}")
    num_seqs, num_heads = query.shape[:2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs \
            or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [{num_seqs}, max_num_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    check_int_vector("seq_lens", seq_lens, num_seqs)
    if partition_size < 16 or partition_size & (partition_size - 1):
        raise ValueError(f"partition_size must be a power of two >= 16, got {partition_size}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} must match query {query.dtype} "
                         f"{tuple(query.shape)}")
    check_last_dim_contiguous(query=query, out=out, block_tables=block_tables)
    check_launchable(_decode_partition_kernel, query, k_cache, v_cache, block_tables, seq_lens,
                     out)
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    if num_seqs == 0 or max_seq_len == 0:
        return out
    num_partitions = triton.cdiv(max_seq_len, partition_size)
    group = num_heads // num_kv_heads
    if num_partitions > 1:
        part_out = torch.empty(num_seqs, num_heads, num_partitions, head_size,
                               dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_seqs, num_heads, num_partitions, dtype=torch.float32,
                               device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        # Never touched (the partition kernel writes straight to out), but float32 like the
        # real ones: a pointer's dtype is part of the kernel's signature, so out's would
        # compile a second variant for short contexts.
        part_out = part_max = part_sum = torch.empty(1, dtype=torch.float32, device=query.device)
    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_max, part_sum,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0), num_partitions,
        GROUP=group, BLOCK_G=max(_MIN_GROUP_BLOCK, triton.next_power_of_2(group)),
        BLOCK_SIZE=block_size, HEAD_SIZE=head_size,
        DOT_DTYPE=dot_dtype(_decode_partition_kernel, query.dtype),
        # 256-wide heads halve the key tile to keep float32 operands in shared memory.
        PARTITION_SIZE=partition_size, BLOCK_N=min(partition_size, 64 if head_size <= 128 else 32),
    )
    if num_partitions > 1:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            out, part_out, part_max, part_sum, seq_lens,
            out.stride(0), out.stride(1), num_partitions,
            HEAD_SIZE=head_size, PARTITION_SIZE=partition_size,
            # One tile width for every context up to _MIN_REDUCE_BLOCK partitions: no variant
            # per power of two as contexts grow.
            BLOCK_P=max(_MIN_REDUCE_BLOCK, triton.next_power_of_2(num_partitions)),
        )
    return out
