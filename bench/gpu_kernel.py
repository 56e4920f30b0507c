"""Achieved bandwidth of the Triton paged decode attention kernel vs a device-to-device copy.

Kernel bandwidth = bytes of K and V the call must read (every context token's K and V rows of
every KV head) / time per call; the query, output and block-table traffic is < 1% of that and
not counted. Copy bandwidth = (bytes read + bytes written) / time of ``dst.copy_(src)`` on a
tensor as large as the K/V read, measured in the same run: the HBM rate this GPU reaches on a
plain stream. Block tables are a random permutation of the cache's blocks, as a long-running
paged cache would be, and the working set is far larger than L2 at the default shapes.

Times come from CUDA events around ``inner`` back-to-back calls (so host launch latency hides
behind the GPU work), after warm-up; the reported time is the median over ``reps``.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShape:
    num_heads: int
    num_kv_heads: int
    head_size: int


@dataclass
class KernelRow:
    batch: int
    context: int
    kv_mib: float  # K + V bytes read per call
    kernel_us: float
    kernel_gbps: float
    copy_us: float
    copy_gbps: float  # read + write
    ratio: float  # kernel / copy bandwidth


def head_shape(model: str) -> HeadShape:
    """The attention shape of a preset (without generating its weights) or a local folder."""
    from engine.presets import PRESETS

    spec = PRESETS.get(model)
    if spec is not None:
        head = spec.head_dim or spec.hidden_size // spec.num_attention_heads
        return HeadShape(spec.num_attention_heads, spec.num_key_value_heads, head)
    from engine.model_config import ModelConfig
    from engine.presets import resolve_model

    cfg = ModelConfig.from_pretrained(resolve_model(model))
    return HeadShape(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)


def cuda_time(fn, reps: int, inner: int, warmup: int = 3) -> float:
    """Median seconds per ``fn()`` call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3 / inner)
    return statistics.median(times)


def measure_shape(batch: int, context: int, shape: HeadShape, block_size: int,
                  dtype: torch.dtype, reps: int, inner: int = 10) -> KernelRow:
    from kernels.triton_decode import paged_decode_attention

    dev = torch.device("cuda")
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = batch * blocks_per_seq
    cache_shape = (num_blocks, block_size, shape.num_kv_heads, shape.head_size)
    k_cache = torch.randn(cache_shape, dtype=dtype, device=dev)
    v_cache = torch.randn(cache_shape, dtype=dtype, device=dev)
    tables = torch.randperm(num_blocks, device=dev).to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    query = torch.randn(batch, shape.num_heads, shape.head_size, dtype=dtype, device=dev)
    out = torch.empty_like(query)
    scale = shape.head_size ** -0.5

    def attend():
        paged_decode_attention(query, k_cache, v_cache, tables, seq_lens, scale, out=out,
                               max_seq_len=context)

    kv_bytes = 2 * batch * context * shape.num_kv_heads * shape.head_size * k_cache.element_size()
    kernel_s = cuda_time(attend, reps, inner)
    del k_cache, v_cache
    src = torch.empty(kv_bytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    copy_s = cuda_time(lambda: dst.copy_(src), reps, inner)
    kernel_gbps = kv_bytes / kernel_s / 1e9
    copy_gbps = 2 * kv_bytes / copy_s / 1e9
    return KernelRow(batch, context, kv_bytes / (1 << 20), kernel_s * 1e6, kernel_gbps,
                     copy_s * 1e6, copy_gbps, kernel_gbps / copy_gbps)


def run_kernel(opts, log) -> list[KernelRow]:
    shape = head_shape(opts.model)
    dtype = getattr(torch, opts.dtype)
    rows = []
    for batch, context in opts.kernel_shapes:
        log(f"kernel: batch {batch} x context {context}, heads {shape.num_heads}/"
            f"{shape.num_kv_heads}x{shape.head_size}, block {opts.kernel_block_size}")
        rows.append(measure_shape(batch, context, shape, opts.kernel_block_size, dtype,
                                  opts.kernel_reps))
        torch.cuda.empty_cache()
    return rows
