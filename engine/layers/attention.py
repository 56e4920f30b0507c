"""The attention layer: hands q/k/v to the backend together with this layer's cache views."""
from __future__ import annotations

import torch
from torch import nn

from kernels.attention_backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = scale
        self.backend = backend
        # Views into the runner's cache tensor, set by bind_kv_cache:
        # [num_blocks, block_size, num_kv_heads, head_size]
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def bind_kv_cache(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        self.k_cache, self.v_cache = k_cache, v_cache

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        # query [T, num_heads, head_size]; key, value [T, num_kv_heads, head_size]
        if self.k_cache.numel() == 0:
            raise RuntimeError("the KV cache is not bound: call model.bind_kv_cache() first")
        return self.backend.forward(query, key, value, self.k_cache, self.v_cache, meta,
                                    self.scale)
