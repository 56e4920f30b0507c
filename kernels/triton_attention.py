"""The Triton attention backend: the GPU path (and, under TRITON_INTERPRET=1, a CPU one for tests).

A step is three launches at most: the K/V write, one decode launch for the leading
``num_decodes`` sequences (split-K over long contexts), one prefill launch for the rest.
"""
from __future__ import annotations

import torch

from kernels.attention_backend import AttentionBackend, AttentionMetadata
from kernels.input_checks import (check_block_size, check_index_bounds, check_query_lens,
                                  index_bounds, index_checks_affordable)
from kernels.triton_cache import reshape_and_cache
from kernels.triton_decode import DEFAULT_PARTITION_SIZE, paged_decode_attention
from kernels.triton_prefill import paged_prefill_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # Kernels read lengths and tables from device tensors only; the host lists merely bound the
    # grid, and under capture they hold static upper bounds, so a captured grid stays valid.
    supports_cuda_graphs = True

    def __init__(self, partition_size: int = DEFAULT_PARTITION_SIZE) -> None:
        self.partition_size = partition_size
        # (meta, longest decode context) of the last step: every layer passes the same meta, so
        # its host-side checks run once per step.
        self._checked: tuple[AttentionMetadata | None, int] = (None, 0)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        checked_meta, max_decode_len = self._checked
        if checked_meta is not meta:
            max_decode_len = _check_meta(meta, k_cache.shape[0], k_cache.shape[1])
            self._checked = (meta, max_decode_len)
        reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        nd = meta.num_decodes
        if nd:
            # Decodes come first, one token each: token row i is sequence i.
            paged_decode_attention(query[:nd], k_cache, v_cache, meta.block_tables[:nd],
                                   meta.seq_lens[:nd], scale, out=out[:nd],
                                   partition_size=self.partition_size,
                                   max_seq_len=max_decode_len)
        if nd < meta.num_seqs:
            # query_start_loc[nd:] holds absolute rows, so the prefill rows of the whole batch
            # are addressed in place and the decode rows stay untouched.
            paged_prefill_attention(query, k_cache, v_cache, meta.block_tables[nd:],
                                    meta.query_start_loc[nd:], meta.seq_lens[nd:],
                                    max(meta.query_lens_list[nd:]), scale, out=out)
        return out


def _check_meta(meta: AttentionMetadata, num_blocks: int, block_size: int) -> int:
    """Host-side checks the kernels cannot afford; returns the longest decode context."""
    check_block_size(meta, block_size)
    check_query_lens(meta)
    # Out-of-range indices make the kernels write outside the cache (under the interpreter,
    # heap corruption), but bounding them on a GPU is a sync a step: there only on request.
    if index_checks_affordable(meta):
        bounds = index_bounds(meta.slot_mapping, meta.block_tables)
        check_index_bounds(bounds, num_blocks, block_size)
    nd = meta.num_decodes
    if any(n != 1 for n in meta.query_lens_list[:nd]):
        raise ValueError("the first num_decodes sequences must have query length 1")
    needed = -(-max(meta.seq_lens_list, default=0) // block_size)
    if meta.block_tables.shape[-1] < needed:
        raise ValueError(f"block_tables has {meta.block_tables.shape[-1]} columns; the longest "
                         f"sequence needs {needed} blocks")
    return max(meta.seq_lens_list[:nd], default=0)
