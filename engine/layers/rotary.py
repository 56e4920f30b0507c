"""Rotary position embedding, neox style (rotate halves), as Llama, Mistral and Qwen use."""
from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.layers.triton_gate import use_triton_fused
from kernels.cpu_fused import fused_ops_usable, rotary_neox_cpu


def compute_inv_freq(head_size: int, base: float,
                     rope_scaling: dict[str, Any] | None = None) -> torch.Tensor:
    """[head_size // 2] float32 inverse frequencies, scaled as the config asks."""
    exponents = torch.arange(0, head_size, 2, dtype=torch.int64).float() / head_size
    inv_freq = 1.0 / (base ** exponents)
    if rope_scaling is None:
        return inv_freq
    rope_type = rope_scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / rope_scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope_scaling)
    raise ValueError(f"rope scaling type {rope_type!r} is not supported")


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
    # between blended smoothly.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def cos_sin_table(max_position: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """[max_position, head_size] float32 on the CPU: each position's cos, then its sin.

    The angles are float32 products, as transformers forms them; their cos and sin are taken
    in float64 by numpy and rounded, so the table is the correctly rounded one on any CPU and
    thread count. torch's float32 cos/sin are not safe here: split over two threads, one
    thread's half of this table came back up to 1.5e-4 off (cos(1) as 0.540334) in about one
    process in 30 on the Zen 4 VM (oneMKL's vector math on first use, by all signs: the same
    call later in the process was exact). The table lives as long as the engine, so every
    request that process served had slightly wrong rotations (greedy steps decided by 3e-3
    flipped; logprobs off by 1e-2).
    """
    positions = np.arange(max_position, dtype=np.float32)
    angles = np.outer(positions, inv_freq.cpu().numpy().astype(np.float32))  # float32 products
    angles = angles.astype(np.float64)
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=-1).astype(np.float32)
    return torch.from_numpy(table)  # [max_position, head_size]


class RotaryEmbedding(nn.Module):
    def __init__(self, head_size: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        cache = cos_sin_table(max_position, compute_inv_freq(head_size, base, rope_scaling))
        self.register_buffer("cos_sin_cache", cache.to(torch.empty(0).device),
                             persistent=False)
        self._checked_positions: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; query [T, num_heads, head_size]; key [T, num_kv_heads, head_size]
        if (query.stride(2) == 1 and key.stride(2) == 1 and fused_ops_usable(query)
                and fused_ops_usable(key) and positions.device.type == "cpu"):
            # Shared by all layers: the step's positions are range-checked by the first.
            rotary_neox_cpu(positions, query, key, self.cos_sin_cache,  # in place
                            positions_checked=positions is self._checked_positions)
            self._checked_positions = positions
            return query, key
        if self._triton_takes(positions, query, key):
            from kernels.triton_fused import rotary_neox_triton

            rotary_neox_triton(positions, query, key, self.cos_sin_cache)  # in place
            return query, key
        return self.forward_torch(positions, query, key)

    def _triton_takes(self, positions: torch.Tensor, query: torch.Tensor,
                      key: torch.Tensor) -> bool:
        head_size = self.head_size
        return (use_triton_fused(query) and key.dtype == query.dtype
                and query.stride(2) == 1 and key.stride(2) == 1
                and head_size & (head_size - 1) == 0 and positions.device == query.device
                and positions.dtype in (torch.int32, torch.int64)
                and self.cos_sin_cache.dtype == torch.float32
                and self.cos_sin_cache.device == query.device)

    def forward_torch(self, positions: torch.Tensor, query: torch.Tensor,
                      key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The plain-torch rotation (new tensors; the inputs are left as they are)."""
        cos_sin = self.cos_sin_cache.index_select(0, positions).to(query.dtype)
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)  # [T, 1, head_size // 2] each
        return _rotate(query, cos, sin), _rotate(key, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
