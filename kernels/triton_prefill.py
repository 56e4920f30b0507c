"""Paged prefill attention in Triton: varlen chunks of queries over their whole paged context.

Sequence i contributes queries query_start_loc[i]:query_start_loc[i + 1] (its new tokens) and
has seq_lens[i] context tokens, the new ones last: query j sits at absolute position
seq_len - query_len + j and sees positions <= its own (causal). K/V for the whole context,
cached prefix and new tokens alike, is read from the paged cache, so the new K/V must be
written (reshape_and_cache) first.

One program per (sequence, query head, tile of BLOCK_M queries), flash-attention style: K/V
tiles stream through an online softmax kept in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.attention_backend import AttentionMetadata
from kernels.reference import reference_paged_attention
from kernels.triton_cache import (check_int_vector, check_kv_caches, check_last_dim_contiguous,
                                  check_launchable, dot_dtype)

_LOG2E = 1.4426950408889634


# Arguments that change from step to step compile no variants of their own: Triton would
# otherwise specialize the table's row stride on divisibility (its width follows the longest
# context) and the per-sequence vectors on 16-byte alignment (a mixed batch passes them from
# row num_decodes on), and compile each new combination mid-serving, a second or more each.
# All three are read as scalars or gathers, so the specializations buy nothing.
@triton.jit(do_not_specialize=["stride_bts"],
            do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr",
                                            "seq_lens_ptr"])
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_size]
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_size]
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_co, stride_ch,
    stride_bts,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_SIZE: tl.constexpr, DOT_DTYPE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    tile_m = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    # The grid covers the longest chunk; shorter chunks leave their tail programs idle.
    if tile_m * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix = seq_len - q_len  # tokens already cached before this chunk
        kv_head = head // GROUP
        rows = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)  # query index within the chunk
        m_mask = rows < q_len
        q_pos = prefix + rows  # absolute positions: [BLOCK_M]
        dims = tl.arange(0, HEAD_SIZE)
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=m_mask[:, None], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, HEAD_SIZE]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_SIZE], tl.float32)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bts
        # Keys past this tile's last query are invisible to all of it.
        kv_end = tl.minimum(prefix + (tile_m + 1) * BLOCK_M, seq_len)
        # Position 0 is in the first tile and visible to every row, so m_i is finite after it
        # and a later tile a row cannot see adds exp2(-inf) = 0 without producing NaN.
        for tile in range(0, kv_end, BLOCK_N):
            pos = tile + tl.arange(0, BLOCK_N)
            n_mask = pos < kv_end
            block = tl.load(table + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            kv_rows = (block * stride_cb + (pos % BLOCK_SIZE) * stride_co
                       + kv_head * stride_ch)  # [BLOCK_N]
            kv_off = kv_rows[:, None] + dims[None, :]  # [BLOCK_N, HEAD_SIZE]
            k = tl.load(k_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            v = tl.load(v_cache_ptr + kv_off, mask=n_mask[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision="ieee")
            s = s * qk_scale  # [BLOCK_M, BLOCK_N]
            visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE),
                                               input_precision="ieee")
            m_i = m_new
        o = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(o, (acc / l_i[:, None]).to(out_ptr.dtype.element_ty), mask=m_mask[:, None])


def paged_prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, max_query_len: int, scale: float,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query [num_tokens, num_heads, head_size] over paged contexts.

    query_start_loc [num_seqs + 1] int32 need not start at 0: rows outside its ranges (say,
    decodes handled by another kernel) are left untouched in ``out``. max_query_len (host int)
    must bound every chunk's length; it sizes the grid. Returns ``out`` (allocated if None).
    """
    _, block_size, num_kv_heads, head_size = check_kv_caches(k_cache, v_cache, query.dtype)
    if query.dim() != 3 or query.shape[2] != head_size:
        raise ValueError(f"query must be [num_tokens, num_heads, {head_size}], got "
                         f"{tuple(query.shape)}")
    num_heads = query.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if block_tables.dim() != 2 or block_tables.dtype != torch.int32:
        raise ValueError("block_tables must be int32 [num_seqs, max_num_blocks], got "
                         f"{block_tables.dtype} {tuple(block_tables.shape)}")
    num_seqs = block_tables.shape[0]
    check_int_vector("query_start_loc", query_start_loc, num_seqs + 1)
    check_int_vector("seq_lens", seq_lens, num_seqs)
    if not isinstance(max_query_len, int) or max_query_len < 0:
        raise ValueError(f"max_query_len must be a non-negative int, got {max_query_len!r}")
    if out is None:
        out = torch.empty_like(query)
    elif out.shape != query.shape or out.dtype != query.dtype:
        raise ValueError(f"out {out.dtype} {tuple(out.shape)} must match query {query.dtype} "
                         f"{tuple(query.shape)}")
    check_last_dim_contiguous(query=query, out=out, block_tables=block_tables)
    check_launchable(_prefill_kernel, query, k_cache, v_cache, block_tables, query_start_loc,
                     seq_lens, out)
    if num_seqs == 0 or max_query_len == 0:
        return out
    # Wide tiles amortize the K/V gather; wider heads shrink them so the float32 accumulator
    # and the dot operands stay within registers and shared memory.
    block_m = 64 if head_size <= 128 else 32
    block_n = 64 if head_size <= 64 else 32
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_query_len, block_m))](
        query, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out,
        scale * _LOG2E,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=block_size, HEAD_SIZE=head_size,
        DOT_DTYPE=dot_dtype(_prefill_kernel, query.dtype),
        BLOCK_M=block_m, BLOCK_N=block_n,
    )
    return out


def paged_prefill_attention_ref(query: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                                scale: float) -> torch.Tensor:
    """Plain-torch twin of ``paged_prefill_attention``: the float64 oracle, writing nothing.
    Returns only the rows query_start_loc covers, [query_start_loc[-1] - query_start_loc[0],
    num_heads, head_size]."""
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    lens = seq_lens.tolist()
    num_tokens = starts[-1] - starts[0]
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64),  # attend only
        query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        query_lens_list=query_lens, seq_lens_list=lens,
        max_query_len=max(query_lens, default=0), max_seq_len=max(lens, default=0),
        block_size=k_cache.shape[1], num_decodes=0)
    q = query[starts[0]:starts[-1]]
    unused_kv = q.new_empty(num_tokens, *k_cache.shape[2:])
    return reference_paged_attention(q, unused_kv, unused_kv, k_cache, v_cache, meta, scale)
