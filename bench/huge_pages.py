"""``pdserve bench huge_pages``: a decode step's linear layers with their oneMKL packs in huge
pages (kernels/huge_pages.py) vs in torch's own 4 KiB pages, side by side.

The same weights are packed twice in one process, once into each kind of memory, and the GEMMs
of one step through every decoder layer and the LM head (a preset's shapes) run alternately
from either, so both see the same machine state. Medians over ``--reps`` steps per row count.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine.presets import PRESETS
from kernels.cpu_mkl_linear import mkl_available, mkl_pack_weight, mkl_packed_linear
from kernels.huge_pages import huge_pages_available


@dataclass
class HugePagesPoint:
    rows: int
    small_pages_ms: float  # torch's allocator (the peer)
    huge_pages_ms: float
    speedup: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", choices=sorted(PRESETS),
                   help="the preset whose linear shapes one step runs")
    p.add_argument("--rows", default="1,8,64", help="tokens per step, comma-separated")
    p.add_argument("--reps", type=int, default=60)
    p.add_argument("--json", action="store_true")


def _shapes(model: str) -> list[tuple[int, int]]:
    """(out_features, in_features) of one step's GEMMs: per layer qkv, o, gate_up, down; the
    LM head last."""
    s = PRESETS[model]
    d = s.head_dim or s.hidden_size // s.num_attention_heads
    q, kv = s.num_attention_heads * d, s.num_key_value_heads * d
    layer = [(q + 2 * kv, s.hidden_size), (s.hidden_size, q),
             (2 * s.intermediate_size, s.hidden_size), (s.hidden_size, s.intermediate_size)]
    return layer * s.num_hidden_layers + [(s.vocab_size, s.hidden_size)]


def run(args) -> list[HugePagesPoint]:
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        raise ValueError(f"--rows takes integers, comma-separated, got {args.rows!r}") from None
    if not rows or min(rows) < 1 or args.reps < 1:
        raise ValueError("need --rows >= 1 each and --reps >= 1")
    if not mkl_available():
        raise ValueError("this torch has no oneMKL packed GEMM")
    if not huge_pages_available():
        raise ValueError("huge pages are off here (PDSERVE_HUGE_PAGES=0, or the kernel's "
                         "transparent huge pages are 'never')")
    gen = torch.Generator().manual_seed(0)
    shapes = _shapes(args.model)
    packs: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for n, k in shapes:
        w = torch.randn(n, k, generator=gen) * 0.02
        packs[False].append(mkl_pack_weight(w, huge_pages=False))
        packs[True].append(mkl_pack_weight(w, huge_pages=True))
    points = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=gen) for k in {k for _, k in shapes}}

        def step(huge: bool) -> None:
            for (n, k), p in zip(shapes, packs[huge]):
                mkl_packed_linear(xs[k], p, n, k)

        times: dict[bool, list[float]] = {False: [], True: []}
        step(False), step(True)
        for r in range(args.reps):
            for huge in ((False, True) if r % 2 else (True, False)):
                t0 = time.perf_counter()
                step(huge)
                times[huge].append(time.perf_counter() - t0)
        small, huge = (statistics.median(times[h]) * 1e3 for h in (False, True))
        points.append(HugePagesPoint(m, small, huge, small / huge))
    return points


def main(args: argparse.Namespace) -> int:
    points = run(args)
    if args.json:
        print(json.dumps({"model": args.model, "threads": torch.get_num_threads(),
                          "points": [asdict(p) for p in points]}))
        return 0
    print(f"{args.model}: one step's linear layers (oneMKL packs), {torch.get_num_threads()} "
          f"threads, median of {args.reps}")
    print("| rows | 4 KiB pages ms | huge pages ms | speed-up |")
    print("|---|---|---|---|")
    for p in points:
        print(f"| {p.rows} | {p.small_pages_ms:.3f} | {p.huge_pages_ms:.3f} | "
              f"**{p.speedup:.2f}x** |")
    return 0
