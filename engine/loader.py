"""Builds a model from a Hugging Face folder and streams its safetensors weights into it."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from engine.layers import LinearBase, ParallelLMHead
from engine.model_config import ModelConfig
from engine.models import build_model
from engine.weight_files import weight_files
from engine.linear_tuning import choose_linear_kernels
from kernels import get_attention_backend
from kernels.attention_backend import AttentionBackend
from kernels.cpu_linear import packed_kernels



def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str,
               attn_backend: AttentionBackend | str, linear_backend: str = "torch",
               pack_threads: int | None = None, prefer_linear: str | None = None) -> nn.Module:
    """The model of ``folder`` with its weights cast to ``dtype`` on ``device``, in eval mode;
    ``linear_backend`` (a resolved name, see kernels.cpu_linear) other than "torch" packs its
    linear layers for that GEMM, or for the fastest one here ("auto", where ``prefer_linear``
    keeps its place unless another is much faster), once the weights are in, for calls of up
    to ``pack_threads`` threads (default: torch's count). ``attn_backend``: a backend, or a
    name (kernels.get_attention_backend) chosen once the model's head size is known."""
    folder = Path(folder)
    cfg = ModelConfig.from_pretrained(folder)
    if isinstance(attn_backend, str):  # a name: resolved for this model's head size
        attn_backend = get_attention_backend(attn_backend, device, cfg.head_dim)
    files = weight_files(folder)
    model = build_model(cfg, dtype, device, attn_backend)
    try:
        model.load_weights(iter_weights(files))
    except ValueError as e:
        raise ValueError(f"{folder}: {e}") from None
    if linear_backend != "torch":
        pack_linear_weights(model, linear_backend, pack_threads, prefer_linear)
    return model


def pack_linear_weights(model: nn.Module, backend: str = "onednn",
                        threads: int | None = None, prefer: str | None = None) -> int:
    """Packs every linear layer and LM head of ``model`` for ``backend`` (a packed GEMM, or
    "auto": the faster of them on this model's shapes here) and calls of up to ``threads``
    threads; how many took it."""
    layers = [m for m in model.modules() if isinstance(m, (LinearBase, ParallelLMHead))]
    few_rows = True
    if backend == "auto":
        weights = _distinct_shapes(layers)
        if not weights:
            return 0
        choice = choose_linear_kernels(
            weights, packed_kernels(weights[0].device, weights[0].dtype), threads, prefer)
        backend, few_rows = choice.kernel, choice.few_rows_kernel
    return sum(m.pack(backend, few_rows, threads) for m in layers)


def _distinct_shapes(layers: list[nn.Module]) -> list[torch.Tensor]:
    """One weight of each linear shape (the first decoder layer's, for a transformer)."""
    seen: dict[tuple[int, ...], torch.Tensor] = {}
    for m in layers:
        if isinstance(m, LinearBase) and m.weight.numel():
            seen.setdefault(tuple(m.weight.shape), m.weight.data)
    return list(seen.values())


def iter_weights(files: list[Path]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in ``files``, one tensor in memory at a time."""
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ValueError(f"cannot read weights file {path}: {e}") from None
