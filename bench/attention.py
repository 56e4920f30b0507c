"""``pdserve bench attention``: one layer's paged decode attention on the CPU, side by side.

In one run, on the same cache and batch: the torch backend (gather the blocks, then SDPA), the
compiled CPU kernel with the blocks scattered at random (what a long-running engine's block
tables look like) and laid out one after another (the best case), and a plain copy of the
same bytes (the memory's limit). K/V bytes read per call over the median time of ``--reps``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from kernels.attention_backend import AttentionMetadata
from kernels.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kernels.torch_attention import TorchAttentionBackend


@dataclass
class AttentionBenchResult:
    num_seqs: int
    context: tuple[int, int]
    kv_bytes: int
    threads: int
    torch_ms: float
    kernel_ms: float
    kernel_contiguous_ms: float
    copy_gb_s: float  # read + write of the same number of bytes
    torch_gb_s: float
    kernel_gb_s: float
    speedup_vs_torch: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-seqs", type=int, default=64)
    p.add_argument("--context", default="300-800", help="context lengths, uniform LO-HI")
    add_layer_args(p)


def add_layer_args(p: argparse.ArgumentParser) -> None:
    """The attention layer's shape (tiny-llama's by default), repetitions, --json."""
    p.add_argument("--num-heads", type=int, default=8)
    p.add_argument("--num-kv-heads", type=int, default=4)
    p.add_argument("--head-size", type=int, default=64)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", action="store_true")


def median_s(fn, reps: int) -> float:
    """Median seconds of ``reps`` calls of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _batch(args, lo: int, hi: int, gen: torch.Generator):
    """A decode batch over a cache whose blocks are scattered: lengths, tables, K, V."""
    n, bs = args.num_seqs, args.block_size
    lens = torch.randint(lo, hi + 1, (n,), dtype=torch.int32, generator=gen)
    width = -(-hi // bs)
    num_blocks = n * width
    tables = torch.randperm(num_blocks, generator=gen).view(n, width).to(torch.int32)
    shape = (num_blocks, bs, args.num_kv_heads, args.head_size)
    return lens, tables, torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)


def run(args) -> AttentionBenchResult:
    try:
        lo, hi = (int(x) for x in args.context.split("-"))
    except ValueError:
        raise ValueError(f"--context must be LO-HI, got {args.context!r}") from None
    if not 1 <= lo <= hi or args.num_seqs < 1 or args.reps < 1:
        raise ValueError("need 1 <= LO <= HI, --num-seqs >= 1 and --reps >= 1")
    if not cpu_kernels_available():
        raise ValueError("the CPU kernels are not available here (no C compiler)")
    gen = torch.Generator().manual_seed(0)
    n, scale = args.num_seqs, args.head_size ** -0.5
    q = torch.randn(n, args.num_heads, args.head_size, generator=gen)
    lens, tables, k, v = _batch(args, lo, hi, gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64),  # attend only, write nothing
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=lens,
        block_tables=tables, query_lens_list=[1] * n, seq_lens_list=lens.tolist(),
        max_query_len=1, max_seq_len=int(lens.max()), block_size=args.block_size, num_decodes=n)
    backend = TorchAttentionBackend()
    unused = torch.zeros(n, args.num_kv_heads, args.head_size)
    torch_s = median_s(lambda: backend.forward(q, unused, unused, k, v, meta, scale), args.reps)
    out = torch.empty_like(q)
    kernel_s = median_s(lambda: paged_decode_attention_cpu(q, k, v, tables, lens, scale, out),
                         args.reps)
    # The same sequences over the same cache, each one's blocks in a row: only the placement
    # differs (a batch of its own drew other lengths, and its GB/s used these bytes).
    tables_c = torch.arange(tables.numel(), dtype=torch.int32).view(tables.shape)
    contiguous_s = median_s(
        lambda: paged_decode_attention_cpu(q, k, v, tables_c, lens, scale, out), args.reps)
    kv_bytes = int(lens.sum()) * args.num_kv_heads * args.head_size * 4 * 2
    src = torch.empty(kv_bytes // 4)
    dst = torch.empty_like(src)
    copy_s = median_s(lambda: dst.copy_(src), args.reps)
    return AttentionBenchResult(
        n, (lo, hi), kv_bytes, torch.get_num_threads(), torch_s * 1e3, kernel_s * 1e3,
        contiguous_s * 1e3, 2 * kv_bytes / copy_s / 1e9, kv_bytes / torch_s / 1e9,
        kv_bytes / kernel_s / 1e9, torch_s / kernel_s)


def main(args: argparse.Namespace) -> int:
    r = run(args)
    if args.json:
        print(json.dumps(asdict(r)))
        return 0
    print(f"{r.num_seqs} decodes, contexts {r.context[0]}-{r.context[1]}, "
          f"{r.kv_bytes / 2**20:.0f} MiB of K/V, {r.threads} threads")
    print("| path | ms | K/V GB/s |")
    print("|---|---|---|")
    print(f"| torch backend (gather + SDPA) | {r.torch_ms:.2f} | {r.torch_gb_s:.1f} |")
    print(f"| C kernel, scattered blocks | {r.kernel_ms:.2f} | {r.kernel_gb_s:.1f} |")
    print(f"| C kernel, contiguous blocks | {r.kernel_contiguous_ms:.2f} | "
          f"{r.kv_bytes / r.kernel_contiguous_ms / 1e6:.1f} |")
    print(f"| copy of the same bytes (read + write) | - | {r.copy_gb_s:.1f} |")
    print(f"\nC kernel / torch backend speed-up: **{r.speedup_vs_torch:.2f}x**")
    return 0
