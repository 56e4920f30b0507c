"""Model registry: architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

import threading

import torch
from torch import nn

from engine.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from kernels.attention_backend import AttentionBackend

# Mistral and Qwen2/3 differ from Llama only in config switches the one decoder handles.
_MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}
# The default dtype is process-global: builds in concurrent threads must not interleave.
_BUILD_LOCK = threading.Lock()


def get_model_class(architecture: str) -> type[nn.Module]:
    cls = _MODEL_REGISTRY.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {', '.join(_MODEL_REGISTRY)}")
    return cls


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str,
                attn_backend: AttentionBackend) -> nn.Module:
    """The model with uninitialised weights, allocated on ``device`` in ``dtype``."""
    if not dtype.is_floating_point:
        raise ValueError(f"compute dtype must be a floating type, got {dtype}")
    cls = get_model_class(cfg.architecture)
    # Layers allocate with the default dtype and device, so set both while building.
    with _BUILD_LOCK:
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            with torch.device(device):
                model = cls(cfg, attn_backend)
        finally:
            torch.set_default_dtype(previous)
    return model.eval()
