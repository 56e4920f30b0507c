"""Engine start-up: resolve the model, pick device and dtype, validate TP, start the executor.

``RankSpec`` is everything one tensor-parallel rank needs to build its share of the model;
rank 0 builds from it in the engine's process and each worker process builds from a copy.
"""
from __future__ import annotations

import dataclasses
import gc
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import DEFAULT_CPU_KV_CACHE_GIB, GIB, EngineConfig, format_bytes
from engine.cpu_graph import preferred_linear_kernel
from engine.cuda_graph import CUDAGraphConfig
from engine.host_memory import available_memory
from engine.kv_layout import make_layout
from engine.loader import load_model
from engine.model_config import ModelConfig
from engine.parallel_state import TPGroup, tp_group_scope
from engine.presets import resolve_model
from engine.tokenizer import Tokenizer
from engine.tokenizer_choice import load_model_tokenizer
from kernels import get_attention_backend
from kernels.cpu_linear import resolve_linear_backend
from kernels.host_malloc import tune_host_malloc
from kernels.mkl_vml import warm_up_vml

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RankSpec:
    """What every TP rank builds from (plain values: it is handed to worker processes)."""

    config: EngineConfig
    model_path: str
    dtype: str  # resolved: float32 | bfloat16 | float16
    device: str  # resolved for rank 0: "cpu" or "cuda:N"

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    def rank_device(self, rank: int) -> torch.device:
        """Rank r runs on the r-th GPU after the configured one; every CPU rank on the CPU."""
        dev = torch.device(self.device)
        if dev.type != "cuda":
            return dev
        return torch.device("cuda", (dev.index or 0) + rank)


def spec_to_json(spec: RankSpec) -> str:
    return json.dumps({"config": dataclasses.asdict(spec.config), "model_path": spec.model_path,
                       "dtype": spec.dtype, "device": spec.device})


def spec_from_json(text: str) -> RankSpec:
    obj = json.loads(text)
    return RankSpec(EngineConfig(**obj["config"]), obj["model_path"], obj["dtype"],
                    obj["device"])


@dataclass
class EngineSetup:
    model_path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer | None
    spec: RankSpec
    device: torch.device
    dtype: torch.dtype


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
    return _DTYPES[cfg.compute_dtype(name, device.type)]


def check_tensor_parallel(cfg: ModelConfig, tp: int, device: torch.device) -> None:
    """Refuses a TP size the model's heads (or the machine's GPUs) cannot be split over."""
    cfg.check_tensor_parallel(tp)
    if device.type == "cuda":
        first = device.index or 0
        if first + tp > torch.cuda.device_count():
            raise ValueError(f"tensor_parallel_size {tp} from {device} needs GPUs "
                             f"{first}..{first + tp - 1}; this machine has "
                             f"{torch.cuda.device_count()}")


def kv_capacity_blocks(config: EngineConfig, bytes_per_block: int, device: torch.device,
                       num_ranks_on_host: int = 1) -> int:
    """How many blocks of ``bytes_per_block`` this rank's budget holds. A cache the memory
    cannot hold is refused here, before it is allocated (``num_ranks_on_host``: the ranks whose
    caches of that size share the host's memory, CPU TP ranks)."""
    budget = config.kv_budget_bytes(device.type == "cpu")
    if config.num_gpu_blocks is not None:
        num_blocks = config.num_gpu_blocks
    elif budget is None:  # CUDA: checked against the free memory as it is sized
        return _blocks_in(_cuda_kv_budget(device, config.gpu_memory_utilization),
                          bytes_per_block, device)
    else:
        num_blocks = _blocks_in(budget, bytes_per_block, device)
    check_kv_cache_fits(config, num_blocks * bytes_per_block, device, num_ranks_on_host)
    return num_blocks


def _blocks_in(budget: float, bytes_per_block: int, device: torch.device) -> int:
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 1:
        hint = (" (lower what else uses the GPU, raise --gpu-memory-utilization, or set "
                "--num-gpu-blocks / --kv-cache-memory-gib)" if device.type == "cuda" else "")
        raise ValueError(f"the KV-cache budget ({format_bytes(budget)}) holds no "
                         f"{format_bytes(bytes_per_block)} block{hint}")
    return num_blocks


def check_kv_cache_fits(config: EngineConfig, cache_bytes: int, device: torch.device,
                        num_ranks_on_host: int = 1) -> None:
    """Refuses a KV cache of ``cache_bytes`` (this rank's) larger than the memory it would be
    allocated in has free: torch failed inside the allocation with a traceback, or on the CPU
    the cache was mapped and the OOM killer ended the process as it was zeroed."""
    if device.type == "cuda":
        free_device_memory()  # what torch holds idle counts as used until handed back
        free = torch.cuda.mem_get_info(device)[0]
        where = f"{device} has only {format_bytes(free)} free"
    else:
        free, where = _host_memory()
        cache_bytes *= num_ranks_on_host
    if free is None or cache_bytes <= free:
        return
    if config.num_gpu_blocks is not None:
        flag = f"--num-gpu-blocks {config.num_gpu_blocks}"
    elif config.kv_cache_memory_gib is not None:
        flag = f"--kv-cache-memory-gib {config.kv_cache_memory_gib:g}"
    else:
        flag = f"the CPU default of {DEFAULT_CPU_KV_CACHE_GIB:g} GiB (--kv-cache-memory-gib)"
    ranks = f" ({num_ranks_on_host} TP ranks' caches)" if device.type == "cpu" \
        and num_ranks_on_host > 1 else ""
    raise ValueError(f"{flag} asks for a KV cache of {format_bytes(cache_bytes)}{ranks}, but "
                     f"{where}: lower --num-gpu-blocks or "
                     "--kv-cache-memory-gib")


def _host_memory() -> tuple[int | None, str]:
    """The host memory a cache may take, and what says so. Not a format string: a cgroup's
    path is any name its creator chose, braces included."""
    mem = available_memory()
    if mem is None:
        return None, ""
    if mem.limit_file is None:
        return mem.nbytes, f"this host has only {format_bytes(mem.nbytes)} available"
    return mem.nbytes, (f"this process's cgroup memory limit ({mem.limit_file}: "
                        f"{format_bytes(mem.limit)}) leaves only {format_bytes(mem.nbytes)} available")


def free_device_memory() -> None:
    """Collects what nothing refers to any more (an engine or model dropped earlier in this
    process, in a reference cycle) and hands torch's idle cached GPU memory back to the
    device, which counts it as used until then; a no-op for the device without CUDA."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _cuda_kv_budget(device: torch.device, utilization: float) -> float:
    """Bytes left for the KV cache when this process may use ``utilization`` of the device:
    that share less what this process holds already (its weights). Per process, as vLLM's
    flag is: two workers on one GPU at 0.45 each get the same caches whichever sized its cache
    first; one that counted the other's memory as its own would leave the second none.
    Idle cached memory goes back first (seen on an H100: a dropped engine's cache, still
    cached, left the next one no budget). A share the device cannot hold beside its other
    users is an error here, not an out-of-memory error at the first long batch."""
    free_device_memory()
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device)
    budget = total * utilization - own
    # What the share still lacks must be free now, beside the (1 - utilization) of the device
    # left to this process's activations, its CUDA context and every other process.
    if budget > free:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} gives this process "
            f"{total * utilization / GIB:.1f} GiB of {device} ({total / GIB:.1f} GiB), "
            f"{budget / GIB:.1f} GiB of it for the KV cache, but only {free / GIB:.1f} GiB is "
            "free: other processes use the rest. Lower --gpu-memory-utilization, or set "
            "--num-gpu-blocks / --kv-cache-memory-gib")
    return budget


def load_rank_model(spec: RankSpec, group: TPGroup) -> torch.nn.Module:
    """This rank's shard of the model, its layers bound to ``group``."""
    device = spec.rank_device(group.rank)
    if device.type == "cpu":  # activations live in host memory: reuse it step to step
        tune_host_malloc()
        # Before any step splits oneMKL's vector math over threads (the sampler's log_): its
        # first call on two threads at once can run one thread on a low-accuracy kernel.
        warm_up_vml()
    torch.manual_seed(spec.config.seed)
    linear = resolve_linear_backend(spec.config.linear_backend, device, spec.torch_dtype)
    # The compiled CPU step runs on one packed GEMM's layers: where it can run, it is preferred.
    prefer = preferred_linear_kernel(spec.torch_dtype, group.size) \
        if cpu_graph_enabled(spec) else None
    with tp_group_scope(group):
        return load_model(spec.model_path, spec.torch_dtype, device,
                          spec.config.attention_backend, linear,
                          spec.config.max_cpu_threads, prefer)


_MAX_GRAPH_BATCH = 512


def cuda_graph_config(spec: RankSpec, cfg: ModelConfig, num_blocks: int) -> CUDAGraphConfig | None:
    """What to capture decode CUDA graphs for; None where steps run eagerly (CPU,
    ``enforce_eager``, or an attention backend that reads host metadata per step)."""
    c = spec.config
    device = spec.rank_device(0)
    if c.enforce_eager or device.type != "cuda":
        return None
    if not get_attention_backend(c.attention_backend, device, cfg.head_dim).supports_cuda_graphs:
        return None
    max_len = min(c.max_model_len or cfg.max_position_embeddings, num_blocks * c.block_size,
                  c.max_seq_len_to_capture)
    # A decode step holds one token per sequence: no batch outgrows the token budget either.
    max_batch = min(c.max_num_seqs, c.max_num_batched_tokens, _MAX_GRAPH_BATCH)
    return CUDAGraphConfig(max_batch_size=max_batch,
                           max_num_blocks_per_seq=-(-max_len // c.block_size),
                           block_size=c.block_size, num_blocks=num_blocks)


def cpu_graph_enabled(spec: RankSpec) -> bool:
    """Whether a TP=1 rank's steps may run through compiled layer code (engine/cpu_graph.py):
    on the CPU, without ``enforce_eager``. The graph still declines models it does not cover."""
    return not spec.config.enforce_eager and spec.rank_device(0).type == "cpu"


def rank_capacity_blocks(spec: RankSpec, cfg: ModelConfig, group: TPGroup) -> int:
    per_block = make_layout(cfg, 1, spec.config.block_size, spec.torch_dtype, group.rank,
                            group.size).bytes_per_block
    device = spec.rank_device(group.rank)
    spec.config.check_kv_budget(per_block, device.type == "cpu")
    # CPU ranks all allocate their caches in the one host's memory.
    on_host = group.size if device.type == "cpu" else 1
    return kv_capacity_blocks(spec.config, per_block, device, on_host)


def resolve_max_model_len(config: EngineConfig, cfg: ModelConfig, num_blocks: int) -> int:
    capacity = num_blocks * config.block_size
    if config.max_model_len is None:
        limit = min(cfg.max_position_embeddings, capacity)
        if not config.enable_chunked_prefill:
            limit = min(limit, config.max_num_batched_tokens)
        if limit < 2:
            # One token of context holds no prompt and an output: every request refused.
            raise ValueError(
                f"this engine would hold {limit} token of context: the KV cache holds "
                f"{capacity} tokens (--num-gpu-blocks, --kv-cache-memory-gib, --block-size)"
                + ("" if config.enable_chunked_prefill else
                   f", a step {config.max_num_batched_tokens} (--max-num-batched-tokens)"))
        return limit
    config.check_max_model_len(cfg.max_position_embeddings, num_blocks)
    return config.max_model_len


def resolve_engine(config: EngineConfig) -> EngineSetup:
    """Everything decided before any rank loads weights; bad choices fail here, early."""
    path = resolve_model(config.model)
    model_config = ModelConfig.from_pretrained(path)
    # A checkpoint without tokenizer files (and no --tokenizer) still serves token-id prompts;
    # broken files are an error. The chosen tokenizer's eos stops requests, as on the router.
    tokenizer = load_model_tokenizer(path, config.tokenizer, model_config.vocab_size)
    if tokenizer is not None:
        model_config = model_config.with_tokenizer_eos(tokenizer.eos_token_id)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config, device)
    check_tensor_parallel(model_config, config.tensor_parallel_size, device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)
    dtype_name = next(k for k, v in _DTYPES.items() if v == dtype)
    spec = RankSpec(config, str(path), dtype_name, str(device))
    return EngineSetup(path, model_config, tokenizer, spec, device, dtype)
