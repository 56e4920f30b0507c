"""Engine start-up: resolve the model, pick device and dtype, load weights, size the cache."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.model_runner import kv_cache_bytes_per_block
from engine.presets import resolve_model
from engine.tokenizer import Tokenizer, load_tokenizer
from kernels import get_attention_backend

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_KV_GIB = 1.0
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass
class EngineSetup:
    model_path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    model: torch.nn.Module
    device: torch.device
    dtype: torch.dtype
    num_blocks: int
    max_model_len: int


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"unknown device {name!r}: {e}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} requested but CUDA is not available")
    return dev


def resolve_dtype(name: str, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU bf16/fp16 matmuls are slow and less exact
    ckpt = _DTYPES.get(str(cfg.torch_dtype).replace("torch.", ""), torch.float32)
    return torch.bfloat16 if ckpt == torch.float32 else ckpt


def size_kv_cache(config: EngineConfig, cfg: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> int:
    if config.num_gpu_blocks is not None:
        return config.num_gpu_blocks
    per_block = kv_cache_bytes_per_block(cfg, config.block_size, dtype)
    if config.kv_cache_memory_gib is not None:
        budget = config.kv_cache_memory_gib * (1 << 30)
    elif device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        budget = total * config.gpu_memory_utilization - used
    else:
        budget = _CPU_KV_GIB * (1 << 30)
    num_blocks = int(budget // per_block)
    if num_blocks < 1:
        raise ValueError(f"the KV-cache budget ({budget / (1 << 20):.1f} MiB) holds no "
                         f"{per_block / (1 << 20):.2f} MiB block")
    return num_blocks


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig, num_blocks: int) -> int:
    capacity = num_blocks * config.block_size
    if config.max_model_len is None:
        limit = min(cfg.max_position_embeddings, capacity)
        if not config.enable_chunked_prefill:
            limit = min(limit, config.max_num_batched_tokens)
        return limit
    if config.max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                         f"max_position_embeddings {cfg.max_position_embeddings}")
    if config.max_model_len > capacity:
        raise ValueError(f"max_model_len {config.max_model_len} does not fit the KV cache "
                         f"({num_blocks} blocks of {config.block_size} tokens = {capacity})")
    return config.max_model_len


def build_engine_parts(config: EngineConfig) -> EngineSetup:
    path = resolve_model(config.model)
    model_config = ModelConfig.from_pretrained(path)
    # A checkpoint without tokenizer files still serves token-id prompts; broken files are an error.
    has_tokenizer = any((path / f).exists() for f in _TOKENIZER_FILES)
    tokenizer = load_tokenizer(path) if has_tokenizer else None
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    torch.manual_seed(config.seed)
    backend = get_attention_backend(config.attention_backend, device)
    model = load_model(path, dtype, device, backend)
    num_blocks = size_kv_cache(config, model_config, dtype, device)
    max_model_len = resolve_max_model_len(config, model_config, num_blocks)
    return EngineSetup(path, model_config, tokenizer, model, device, dtype, num_blocks, max_model_len)
