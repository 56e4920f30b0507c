"""Obviously-correct paged attention, one token at a time in float64: the tests' oracle."""
from __future__ import annotations

import torch

from kernels.attention_backend import AttentionMetadata


def reference_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as ``AttentionBackend.forward``; slow, for tests only."""
    block_size = meta.block_size
    for t, slot in enumerate(meta.slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(query)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_list, meta.seq_lens_list)):
        table = meta.block_tables[i].tolist()
        # The whole context of sequence i, position by position: [seq_len, kv_heads, head_size]
        ks = torch.stack([k_cache[table[p // block_size], p % block_size]
                          for p in range(seq_len)]).double()
        vs = torch.stack([v_cache[table[p // block_size], p % block_size]
                          for p in range(seq_len)]).double()
        for j in range(q_len):
            visible = seq_len - q_len + j + 1  # causal: positions <= this query's position
            for h in range(num_heads):
                q = query[start + j, h].double()
                scores = (ks[:visible, h // group] @ q) * scale  # [visible]
                weights = torch.softmax(scores, dim=0)
                out[start + j, h] = (weights @ vs[:visible, h // group]).to(out.dtype)
        start += q_len
    return out


def paged_decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain-torch twin of the paged decode kernels (Triton and CPU): the float64 oracle,
    writing nothing. query [num_seqs, num_heads, head_size], one token per sequence."""
    num_seqs = query.shape[0]
    lens = seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=torch.full((num_seqs,), -1, dtype=torch.int64),  # attend only
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.int32),
        seq_lens=seq_lens, block_tables=block_tables,
        query_lens_list=[1] * num_seqs, seq_lens_list=lens,
        max_query_len=1, max_seq_len=max(lens, default=0), block_size=k_cache.shape[1],
        num_decodes=num_seqs)
    unused_kv = query.new_empty(num_seqs, *k_cache.shape[2:])
    return reference_paged_attention(query, unused_kv, unused_kv, k_cache, v_cache, meta, scale)
