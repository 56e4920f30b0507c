"""``pdserve bench huge_pages``: what a decode step reads, in huge pages (kernels/huge_pages.py)
vs in torch's own 4 KiB pages, side by side.

Linear layers: the same weights are packed twice in one process, once into each kind of
memory, and the GEMMs of one step through every decoder layer and the LM head (a preset's
shapes) run alternately from either, so both see the same machine state. Decode attention:
one layer's paged K/V (blocks scattered at random, as in a long-running engine) copied into
each kind of memory, read by the compiled decode kernel alternately. Medians over ``--reps``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from engine.presets import PRESETS
from kernels.cpu_decode import cpu_kernels_available, paged_decode_attention_cpu
from kernels.cpu_mkl_linear import mkl_available, mkl_pack_weight, mkl_packed_linear
from kernels.huge_pages import huge_pages_available, to_huge_pages


@dataclass
class HugePagesPoint:
    what: str  # "linear" (rows: tokens in the step) or "attention" (rows: decodes)
    rows: int
    small_pages_ms: float  # torch's allocator (the peer)
    huge_pages_ms: float
    speedup: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-llama", choices=sorted(PRESETS),
                   help="the preset whose linear shapes one step runs")
    p.add_argument("--rows", default="1,8,64", help="tokens per step, comma-separated")
    p.add_argument("--decodes", default="8,32", help="decode attention: sequences per step, "
                   "comma-separated ('' for none)")
    p.add_argument("--context", type=int, default=700, help="decode attention: tokens each")
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
    try:
        decodes = [int(r) for r in args.decodes.split(",")] if args.decodes else []
    except ValueError:
        raise ValueError(f"--decodes takes integers, comma-separated, got {args.decodes!r}") \
            from None
    if not rows or min(rows) < 1 or min(decodes, default=1) < 1 or args.reps < 1 \
            or args.context < 1:
        raise ValueError("need --rows and --decodes >= 1 each, --context >= 1 and --reps >= 1")
    if decodes and not cpu_kernels_available():
        raise ValueError("the compiled CPU kernels are not available here (no C compiler)")
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

        points.append(_alternate("linear", m, step, args.reps))
    for n in decodes:
        points.append(_attention_point(args, n, gen))
    return points


def _alternate(what: str, rows: int, step, reps: int) -> HugePagesPoint:
    """``step(huge)`` timed ``reps`` times each way, the order alternating."""
    times: dict[bool, list[float]] = {False: [], True: []}
    step(False), step(True)
    for r in range(reps):
        for huge in ((False, True) if r % 2 else (True, False)):
            t0 = time.perf_counter()
            step(huge)
            times[huge].append(time.perf_counter() - t0)
    small, huge = (statistics.median(times[h]) * 1e3 for h in (False, True))
    return HugePagesPoint(what, rows, small, huge, small / huge)


def _attention_point(args, n: int, gen: torch.Generator) -> HugePagesPoint:
    s = PRESETS[args.model]
    d = s.head_dim or s.hidden_size // s.num_attention_heads
    bs, width = 16, -(-args.context // 16)
    shape = (n * width, bs, s.num_key_value_heads, d)
    small = {"k": torch.randn(shape, generator=gen), "v": torch.randn(shape, generator=gen)}
    huge = {name: to_huge_pages(t) for name, t in small.items()}
    tables = torch.randperm(n * width, generator=gen).to(torch.int32).view(n, width)
    lens = torch.full((n,), args.context, dtype=torch.int32)
    q = torch.randn(n, s.num_attention_heads, d, generator=gen)
    out = torch.empty_like(q)

    def step(use_huge: bool) -> None:
        c = huge if use_huge else small
        paged_decode_attention_cpu(q, c["k"], c["v"], tables, lens, d ** -0.5, out)

    return _alternate("attention", n, step, args.reps)


def main(args: argparse.Namespace) -> int:
    points = run(args)
    if args.json:
        print(json.dumps({"model": args.model, "threads": torch.get_num_threads(),
                          "points": [asdict(p) for p in points]}))
        return 0
    print(f"{args.model}: one step's linear layers (oneMKL packs) and one layer's decode "
          f"attention ({args.context}-token contexts), {torch.get_num_threads()} threads, "
          f"median of {args.reps}")
    print("| what | rows / decodes | 4 KiB pages ms | huge pages ms | speed-up |")
    print("|---|---|---|---|---|")
    for p in points:
        print(f"| {p.what} | {p.rows} | {p.small_pages_ms:.3f} | {p.huge_pages_ms:.3f} | "
              f"**{p.speedup:.2f}x** |")
    return 0
