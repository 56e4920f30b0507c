"""Per-layer K/V cache views shaped like the engine's: layer ``layer`` of a block-major cache
(engine/kv_layout.py), so kernels are tested on the strides they meet in the engine."""
from __future__ import annotations

import torch


def block_major_views(k_cache: torch.Tensor, v_cache: torch.Tensor, num_layers: int = 3,
                      layer: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies ``k_cache`` and ``v_cache`` [num_blocks, block_size, num_kv_heads, head_size]
    into layer ``layer`` of a ``[num_blocks, num_layers, 2, ...]`` cache and returns that
    layer's two views. Every other layer holds NaN, so a kernel that strays outside its
    layer's blocks produces NaN instead of a plausible number."""
    if not 0 <= layer < num_layers:
        raise ValueError(f"layer {layer} is not in [0, {num_layers})")
    full = torch.full((k_cache.shape[0], num_layers, 2, *k_cache.shape[1:]), float("nan"),
                      dtype=k_cache.dtype, device=k_cache.device)
    full[:, layer, 0] = k_cache
    full[:, layer, 1] = v_cache
    return full[:, layer, 0], full[:, layer, 1]
