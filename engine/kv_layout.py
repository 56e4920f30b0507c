"""What one rank's paged KV cache looks like: enough for a remote reader to address its bytes.

The cache tensor of a rank is
``[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_size]``, contiguous, where
``num_kv_heads`` are the heads ``[kv_head_start, kv_head_start + num_kv_heads)`` of the model's
``total_num_kv_heads``. KV transfer matches layouts before moving a byte.

Block-major, so that everything a transfer moves for one block (all layers, K and V) is one
contiguous run: a pull of n scattered blocks is n descriptors rather than
``num_layers * 2 * n``, and the kernel's cross-process copy moves long runs (measured on the
2-core VM: 0.42 -> 0.6 of an in-process memcpy at 16-256 MB). Each layer's K (or V) view,
``cache[:, layer, 0]``, is ``[num_blocks, block_size, num_kv_heads, head_size]`` with a block
stride of ``block_elems`` times ``2 * num_layers``; attention reads a block at a time, so the
stride costs it nothing.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch-free at run time: workers and routers read layouts too
    import torch

    from engine.model_config import ModelConfig

# The cache dtypes a layout names.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# Named in every layout so that a peer built with another dimension order is refused by the
# layout check instead of moving the wrong bytes.
BLOCK_MAJOR = "block,layer,kv,token,head,dim"


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
    order: str = BLOCK_MAJOR

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads,
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
    def from_dict(cls, fields: dict) -> KVCacheLayout:
        """From a peer's fields, every one required: a peer that does not name its dimension
        order predates it, and its bytes are in another order."""
        if not isinstance(fields, dict):
            raise ValueError(f"not a KV cache layout: {type(fields).__name__}")
        missing = sorted(set(cls.__dataclass_fields__) - set(fields))
        if missing:
            raise ValueError(f"not a KV cache layout: missing {missing}")
        for f in dataclasses.fields(cls):
            value = fields[f.name]
            want = int if f.type == "int" else str
            if not isinstance(value, want) or isinstance(value, bool):
                raise ValueError(f"not a KV cache layout: {f.name} must be {f.type}, "
                                 f"got {value!r}")
        try:
            return cls(**fields)
        except TypeError as e:
            raise ValueError(f"not a KV cache layout: {e}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> KVCacheLayout:
        try:
            fields = json.loads(text)
        except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
            raise ValueError(f"not a KV cache layout: {e}") from None
        return cls.from_dict(fields)


def dtype_name(dtype: torch.dtype | str) -> str | None:
    """A torch dtype's name in layouts ("float32", ...), or a name given as such; None for a
    dtype caches never have."""
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    return name if name in DTYPE_NAMES else None


def make_layout(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype | str,
                tp_rank: int = 0, tp_size: int = 1) -> KVCacheLayout:
    """Rank ``tp_rank``'s layout; ``dtype`` a torch dtype or its name (torch-free callers:
    `pdserve up` sizes a rank's blocks with it before anything starts)."""
    if dtype_name(dtype) is None:
        raise ValueError(f"a KV cache cannot hold {dtype} (choose from {DTYPE_NAMES})")
    heads = kv_head_range(cfg.num_key_value_heads, tp_size, tp_rank)
    return KVCacheLayout(
        num_layers=cfg.num_hidden_layers, num_blocks=num_blocks, block_size=block_size,
        num_kv_heads=heads.num, kv_head_start=heads.start,
        total_num_kv_heads=cfg.num_key_value_heads, head_size=cfg.head_dim,
        dtype=dtype_name(dtype), tp_rank=tp_rank, tp_size=tp_size)


@dataclass(frozen=True)
class KVHeadRange:
    """The KV heads one rank holds: [start, start + num) of the model's KV heads."""

    start: int
    num: int


def kv_head_range(total_num_kv_heads: int, tp_size: int, tp_rank: int) -> KVHeadRange:
    """Splits KV heads across ranks; with fewer heads than ranks each head is replicated.

    With tp_size > total heads, rank r holds the single head r // (tp_size // total), so each
    head lives on tp_size // total consecutive ranks.
    """
    if tp_size >= total_num_kv_heads:
        if tp_size % total_num_kv_heads:
            raise ValueError(f"tensor-parallel size ({tp_size}) is not divisible by the number "
                             f"of KV heads ({total_num_kv_heads})")
        return KVHeadRange(tp_rank // (tp_size // total_num_kv_heads), 1)
    if total_num_kv_heads % tp_size:
        raise ValueError(f"number of KV heads ({total_num_kv_heads}) is not divisible by "
                         f"{tp_size}")
    num = total_num_kv_heads // tp_size
    return KVHeadRange(tp_rank * num, num)
