"""``pdserve bench kvtransfer``: KV block transfer between two processes vs memcpy in one.

For each transfer size (1 MB .. 256 MB of paged blocks, tiny-llama's block shape, random
block ids on both sides) it times a pull by each backend from an owner process into this
process, and in the same run a plain contiguous copy of the same number of bytes within this
process: the limit a transfer between two processes on one host can approach. The copy runs
on one thread (a plain memcpy: a pull is one stream too) and on all of torch's threads; the
ratio is against the one-thread copy. A second limit is the kernel's own: one thread calling
``process_vm_readv`` (CMA, what UCX uses between processes on one host) over the runs of the
same pull, from the owner's cache; a pull's ratio to it is how close it gets to what the OS
allows one thread. With ``--block-ids random`` (the default) blocks are scattered on both
sides; ``contiguous`` moves one run of neighbouring blocks. ``--nixl-streams N`` splits NIXL
pulls of 8 MB or more over N threads (the agent's ``pull_streams``). It also times a single
request's handoff (the blocks of a 1k-token prompt, with the release notification) for
tiny-llama and for qwen3-0.6b-shape (bf16, the checkpoint dtype served on GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from bench import cma
from engine.kv_layout import KVCacheLayout
from engine.presets import PRESETS
from kvtransfer import BACKENDS, KVAgentHandle, make_agent
from kvtransfer.nixl_agent import SPLIT_MIN_BYTES, pull_streams_setting

SIZES_MB = (1, 4, 16, 64, 256)
MB = 1 << 20
HANDOFF_TOKENS = 1024


@dataclass
class SizeResult:
    size_mb: int
    num_blocks: int
    memcpy_gb_s: float  # one thread
    copy_all_threads_gb_s: float
    backend_gb_s: dict[str, float]
    ratio: dict[str, float]
    cma_gb_s: float | None = None  # one thread of process_vm_readv; None when refused
    cma_ratio: dict[str, float] = field(default_factory=dict)  # backend / cma


@dataclass
class SizesRun:
    sizes: list[SizeResult]
    cma_note: str  # why the CMA figures are missing ("" when measured)


@dataclass
class HandoffResult:
    model: str
    backend: str
    num_blocks: int
    num_bytes: int
    median_ms: float
    best_ms: float


def preset_layout(name: str, num_blocks: int, block_size: int = 16,
                  dtype: str | None = None) -> KVCacheLayout:
    p = PRESETS[name]
    head = p.head_dim or p.hidden_size // p.num_attention_heads
    return KVCacheLayout(num_layers=p.num_hidden_layers, num_blocks=num_blocks,
                         block_size=block_size, num_kv_heads=p.num_key_value_heads,
                         kv_head_start=0, total_num_kv_heads=p.num_key_value_heads,
                         head_size=head, dtype=dtype or "float32", tp_rank=0, tp_size=1)


def _cache(layout: KVCacheLayout, fill: bool) -> torch.Tensor:
    cache = torch.empty(layout.shape, dtype=getattr(torch, layout.dtype))
    if fill:  # distinct bytes everywhere, cheaply (randn over 256 MB is slow on 2 cores)
        flat = cache.view(-1)
        flat.copy_(torch.arange(flat.numel(), dtype=torch.float32).to(cache.dtype))
    else:
        cache.zero_()
    return cache


class OwnerProcess:
    """An owner agent in its own process: ``python -m bench.kvtransfer serve``."""

    def __init__(self, backend: str, layout: KVCacheLayout) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.kvtransfer", "serve", backend, layout.to_json()],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        line = ""
        while not line.startswith("HANDLE "):
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {backend} owner process exited during start-up")
        self.handle = KVAgentHandle.from_bytes(bytes.fromhex(line.split()[1]))

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def serve(backend: str, layout_json: str) -> None:
    layout = KVCacheLayout.from_json(layout_json)
    with make_agent(backend, _cache(layout, fill=True), layout) as agent:
        print("HANDLE", agent.handle().to_bytes().hex(), flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin


def _time(fn, min_reps: int, min_s: float) -> list[float]:
    times = []
    t_end = time.perf_counter() + min_s
    while len(times) < min_reps or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _memcpy_gb_s(num_bytes: int, reps: int, threads: int) -> float:
    src = torch.ones(num_bytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = _time(lambda: dst.copy_(src), reps, 0.2)
    finally:
        torch.set_num_threads(before)
    return num_bytes / statistics.median(times) / 1e9


def _block_ids(rng, num_blocks: int, n: int, contiguous: bool) -> list[int]:
    if contiguous:  # one run of neighbouring blocks, as a fresh allocation hands out
        start = int(rng.integers(0, num_blocks - n + 1))
        return list(range(start, start + n))
    return rng.permutation(num_blocks)[:n].tolist()


def _cma_gb_s(owner: OwnerProcess, layout: KVCacheLayout, cache: torch.Tensor,
              src: list[int], dst: list[int], reps: int) -> float:
    local, remote = cma.block_iovecs(layout, cache.data_ptr(), owner.handle.layout,
                                     owner.handle.base_addr, np.asarray(src), np.asarray(dst))
    pid = owner.proc.pid
    times = _time(lambda: cma.read(pid, local, remote), reps, 0.5)
    return int(local[:, 1].sum()) / statistics.median(times) / 1e9


def _reader(backend: str, cache: torch.Tensor, layout: KVCacheLayout, nixl_streams: int):
    return make_agent(backend, cache, layout,
                      pull_streams=nixl_streams if backend == "nixl" else None)


def _time_pulls(backend: str, owner: OwnerProcess, layout: KVCacheLayout,
                results: list[SizeResult], ids: list[tuple[list[int], list[int]]], reps: int,
                with_cma: bool, nixl_streams: int) -> None:
    """Fills each size's figures for ``backend`` (and CMA's, right after the same pull)."""
    per_block = layout.bytes_per_block
    cache = _cache(layout, fill=False)
    with _reader(backend, cache, layout, nixl_streams) as agent:
        agent.pull([owner.handle], [0], [0], 60.0)  # connect outside the timing
        for r, (src, dst) in zip(results, ids):
            times = _time(lambda: agent.pull([owner.handle], src, dst, 120.0), reps, 0.5)
            r.backend_gb_s[backend] = r.num_blocks * per_block / statistics.median(times) / 1e9
            r.ratio[backend] = r.backend_gb_s[backend] / r.memcpy_gb_s
            if with_cma:
                r.cma_gb_s = _cma_gb_s(owner, layout, cache, src, dst, reps)
        check = np.random.default_rng(1).permutation(layout.num_blocks)[:8].tolist()
        agent.pull([owner.handle], check, list(range(8)), 60.0)
        expect = _cache(layout, fill=True)[check]
        if not torch.equal(cache[:8], expect):
            raise RuntimeError(f"{backend}: transferred bytes differ from the owner's")


def run_sizes(backends: list[str], sizes_mb: tuple[int, ...], reps: int,
              contiguous: bool = False, nixl_streams: int = 1) -> SizesRun:
    per_block = preset_layout("tiny-llama", 1).bytes_per_block
    max_blocks = max(sizes_mb) * MB // per_block
    layout = preset_layout("tiny-llama", max_blocks + 64)
    rng = np.random.default_rng(0)
    results = [SizeResult(s, s * MB // per_block, _memcpy_gb_s(s * MB, reps, 1),
                          _memcpy_gb_s(s * MB, reps, torch.get_num_threads()), {}, {})
               for s in sizes_mb]
    # Every backend and the CMA read move the same blocks.
    ids = [(_block_ids(rng, layout.num_blocks, r.num_blocks, contiguous),
            _block_ids(rng, layout.num_blocks, r.num_blocks, contiguous)) for r in results]
    cma_note = "no backend ran"
    for i, backend in enumerate(backends):
        owner = OwnerProcess(backend, layout)
        try:
            if i == 0:  # any owner's cache will do: CMA is measured once per size
                cma_note = cma.probe(owner.proc.pid, owner.handle.base_addr)
            _time_pulls(backend, owner, layout, results, ids, reps, i == 0 and not cma_note,
                        nixl_streams)
        finally:
            owner.close()
    for r in results:
        if r.cma_gb_s:
            r.cma_ratio = {b: r.backend_gb_s[b] / r.cma_gb_s for b in backends}
    return SizesRun(results, cma_note)


def run_handoffs(backends: list[str], reps: int, nixl_streams: int = 1) -> list[HandoffResult]:
    out = []
    for model, dtype in (("tiny-llama", "float32"), ("qwen3-0.6b-shape", "bfloat16")):
        n = HANDOFF_TOKENS // 16
        layout = preset_layout(model, n + 8, dtype=dtype)
        for backend in backends:
            owner = OwnerProcess(backend, layout)
            try:
                with _reader(backend, _cache(layout, fill=False), layout,
                             nixl_streams) as agent:
                    agent.pull([owner.handle], [0], [0], 60.0)
                    ids = list(range(n))
                    times = _time(lambda: agent.pull([owner.handle], ids, ids, 120.0,
                                                     notify=b"release:bench"), reps, 0.5)
            finally:
                owner.close()
            out.append(HandoffResult(model, backend, n, n * layout.bytes_per_block,
                                     statistics.median(times) * 1e3, min(times) * 1e3))
    return out


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=[*BACKENDS, "all"], default="all")
    p.add_argument("--sizes-mb", default=",".join(map(str, SIZES_MB)),
                   help="comma-separated transfer sizes in MB")
    p.add_argument("--reps", type=int, default=5, help="at least this many pulls per point")
    p.add_argument("--block-ids", choices=["random", "contiguous"], default="random",
                   help="random: scattered blocks on both sides (the worst case); contiguous: "
                   "one run of neighbouring blocks on each side")
    p.add_argument("--nixl-streams", type=int, default=1,
                   help=f"threads a NIXL pull of {SPLIT_MIN_BYTES // MB} MB or more is split "
                   "over (1: the caller's only)")
    p.add_argument("--json", action="store_true", help="one JSON object instead of tables")


def main(args: argparse.Namespace) -> int:
    backends = list(BACKENDS) if args.backend == "all" else [args.backend]
    try:
        sizes = tuple(int(s) for s in args.sizes_mb.split(","))
    except ValueError:
        raise ValueError(f"--sizes-mb must be integers, got {args.sizes_mb!r}") from None
    if not sizes or min(sizes) < 1 or args.reps < 1:
        raise ValueError("--sizes-mb must be positive and --reps >= 1")
    pull_streams_setting(args.nixl_streams)  # a bad value fails before minutes of timing
    run = run_sizes(backends, sizes, args.reps, args.block_ids == "contiguous", args.nixl_streams)
    handoffs = run_handoffs(backends, args.reps, args.nixl_streams)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(), "block_ids": args.block_ids,
                          "nixl_streams": args.nixl_streams,
                          "sizes": [asdict(r) for r in run.sizes], "cma_note": run.cma_note,
                          "handoffs": [asdict(h) for h in handoffs]}, indent=2))
    else:
        if args.nixl_streams > 1 and "nixl" in backends:
            print(f"nixl: pulls of {SPLIT_MIN_BYTES // MB} MB or more split over "
                  f"{args.nixl_streams} threads\n")
        _print_tables(backends, run, handoffs)
    return 0


def _print_tables(backends: list[str], run: SizesRun, handoffs: list[HandoffResult]) -> None:
    def fmt(v: float | None, bold: bool = False) -> str:
        if v is None:
            return ""
        return f"**{v:.2f}**" if bold else f"{v:.2f}"

    head = " | ".join(f"{b} GB/s | {b}/memcpy | {b}/cma" for b in backends)
    print(f"| size | blocks | memcpy GB/s | copy, {torch.get_num_threads()} threads GB/s | "
          f"cma GB/s | {head} |")
    print("|---|---|---|---|---|" + "---|---|---|" * len(backends))
    for r in run.sizes:
        cols = " | ".join(f"{fmt(r.backend_gb_s[b])} | {fmt(r.ratio[b], True)} | "
                          f"{fmt(r.cma_ratio.get(b), True)}" for b in backends)
        print(f"| {r.size_mb} MB | {r.num_blocks} | {r.memcpy_gb_s:.2f} | "
              f"{r.copy_all_threads_gb_s:.2f} | {fmt(r.cma_gb_s)} | {cols} |")
    if run.cma_note:
        print(f"\ncma (one thread of process_vm_readv) not measured: {run.cma_note}")
    print()
    print("| handoff (1k-token prompt) | backend | blocks | MB | median ms | best ms |")
    print("|---|---|---|---|---|---|")
    for h in handoffs:
        print(f"| {h.model} | {h.backend} | {h.num_blocks} | {h.num_bytes / MB:.1f} | "
              f"{h.median_ms:.2f} | {h.best_ms:.2f} |")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3])
    else:
        ap = argparse.ArgumentParser(prog="python -m bench.kvtransfer")
        add_args(ap)
        sys.exit(main(ap.parse_args()))
