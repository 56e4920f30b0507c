"""What one rank's paged KV cache looks like: enough for a remote reader to address its bytes.

The cache tensor of a rank is
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_size]``, contiguous, where
``num_kv_heads`` are the heads ``[kv_head_start, kv_head_start + num_kv_heads)`` of the model's
``total_num_kv_heads``. KV transfer matches layouts before moving a byte.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import torch

from engine.model_config import ModelConfig
from engine.parallel_state import kv_head_range

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int  # on this rank
    kv_head_start: int
    total_num_kv_heads: int
    head_size: int
    dtype: str
    tp_rank: int
    tp_size: int

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads,
                self.head_size)

    @property
    def element_size(self) -> int:
        return 2 if self.dtype in ("bfloat16", "float16") else 4

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers, K and V (what a transfer moves per block)."""
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size
                * self.element_size)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> KVCacheLayout:
        try:
            fields = json.loads(text)
            return cls(**fields)
        except (ValueError, TypeError) as e:
            raise ValueError(f"not a KV cache layout: {e}") from None


def make_layout(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                tp_rank: int = 0, tp_size: int = 1) -> KVCacheLayout:
    heads = kv_head_range(cfg.num_key_value_heads, tp_size, tp_rank)
    return KVCacheLayout(
        num_layers=cfg.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=heads.num, kv_head_start=heads.start,
        total_num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim,
        dtype=DTYPE_NAMES[dtype], tp_rank=tp_rank, tp_size=tp_size)
