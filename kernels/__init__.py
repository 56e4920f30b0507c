"""Attention backends behind one interface (kernels.attention_backend)."""
from __future__ import annotations

import torch

from kernels.attention_backend import AttentionBackend, AttentionMetadata
from kernels.torch_attention import TorchAttentionBackend

BACKENDS = ("auto", "torch")


def get_attention_backend(name: str = "auto",
                          device: torch.device | str | None = None) -> AttentionBackend:
    """The attention backend called ``name``; "auto" picks the best one for ``device``."""
    if name in ("auto", "torch"):
        # Only the torch backend exists yet; "auto" will prefer Triton on GPUs once it lands.
        return TorchAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r} (choose from {', '.join(BACKENDS)})")


__all__ = ["AttentionBackend", "AttentionMetadata", "TorchAttentionBackend",
           "get_attention_backend"]
