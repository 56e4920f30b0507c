"""The attention-backend interface every model layer calls.

A backend writes the step's new K/V into the paged cache through ``slot_mapping`` and then
attends each sequence's queries over its whole context (cached prefix + new tokens), reading
the context through the sequence's block table. One flattened batch mixes prefill chunks and
decodes; sequences are laid out back to back along the token axis (``query_start_loc``).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Per-step layout of the flattened batch, shared by all layers.

    Tensors live on the model's device. The ``*_list`` fields are host copies so CPU code can
    loop without device syncs.
    """

    # [num_tokens] int64: cache slot (block_id * block_size + offset) of each new token.
    slot_mapping: torch.Tensor
    # [num_seqs + 1] int32: offsets of each sequence's queries in the token axis.
    query_start_loc: torch.Tensor
    # [num_seqs] int32: context length after this step (cached + new tokens).
    seq_lens: torch.Tensor
    # [num_seqs, max_num_blocks] int32: block ids, right-padded with 0.
    block_tables: torch.Tensor
    query_lens_list: list[int]
    seq_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Sequences [0, num_decodes) have query length 1; the rest are prefill chunks.
    # The runner orders decodes first so backends can batch them.
    num_decodes: int = 0

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])


class AttentionBackend(ABC):
    """Stores new K/V into the paged cache, then runs paged attention."""

    name: str = "abstract"
    # Whether a decode step can be captured in a CUDA graph and replayed: the backend must read
    # only device tensors of the metadata (host lists hold capture-time upper bounds then).
    supports_cuda_graphs: bool = False

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_size]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        ...
