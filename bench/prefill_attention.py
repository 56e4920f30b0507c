"""``pdserve bench prefill_attention``: one layer's attention for prefill chunks after a cached
prefix (chunked prefill, prefix-cache hits), side by side on the same cache.

The torch backend folds the query heads that share a KV head into one longer query over that
head's K/V. Its peer here is what a GQA model costs without the fold: flash SDPA over a copy of
the gathered context's K/V per query head (SDPA's own ``enable_gqa`` takes the unfused math
path on the CPU). Both read the same paged cache; the outputs are checked equal before timing.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from bench.attention import add_layer_args, median_s
from kernels.attention_backend import AttentionMetadata
from kernels.torch_attention import TorchAttentionBackend


@dataclass
class PrefillAttentionPoint:
    query_len: int  # the chunk's tokens
    seq_len: int  # cached prefix + chunk
    folded_ms: float  # the backend
    per_head_copy_ms: float  # the peer
    speedup: float


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shapes", default="62x510,16x1024,512x1024,512x2048",
                   help="QUERY_LENxSEQ_LEN chunks, comma-separated (62x510: the serving "
                        "benchmark's warm shared-prefix prompt)")
    add_layer_args(p)


def _shapes(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            q_len, seq_len = (int(x) for x in item.split("x"))
        except ValueError:
            raise ValueError(f"--shapes takes QUERY_LENxSEQ_LEN items, got {item!r}") from None
        if not 1 <= q_len < seq_len:
            raise ValueError(f"a chunk after a cached prefix needs 1 <= QUERY_LEN < SEQ_LEN, "
                             f"got {item!r}")
        out.append((q_len, seq_len))
    return out


def _point(args, q_len: int, seq_len: int, gen: torch.Generator) -> PrefillAttentionPoint:
    bs, heads, kv_heads, d = args.block_size, args.num_heads, args.num_kv_heads, args.head_size
    num_blocks = -(-seq_len // bs)
    table = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    k_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    v_cache = torch.randn(num_blocks, bs, kv_heads, d, generator=gen)
    q = torch.randn(q_len, heads, d, generator=gen)
    meta = AttentionMetadata(
        slot_mapping=torch.full((q_len,), -1, dtype=torch.int64),  # attend only, write nothing
        query_start_loc=torch.tensor([0, q_len], dtype=torch.int32),
        seq_lens=torch.tensor([seq_len], dtype=torch.int32), block_tables=table[None],
        query_lens_list=[q_len], seq_lens_list=[seq_len], max_query_len=q_len,
        max_seq_len=seq_len, block_size=bs, num_decodes=0)
    scale = d ** -0.5
    backend = TorchAttentionBackend()
    unused = torch.zeros(q_len, kv_heads, d)
    start = seq_len - q_len
    visible = torch.arange(seq_len)[None, :] <= torch.arange(start, seq_len)[:, None]
    mask = torch.zeros(q_len, seq_len).masked_fill_(~visible, float("-inf"))
    group = heads // kv_heads

    def per_head_copy() -> torch.Tensor:
        ids = table.long()
        k = k_cache.index_select(0, ids).view(-1, kv_heads, d)[:seq_len].transpose(0, 1)
        v = v_cache.index_select(0, ids).view(-1, kv_heads, d)[:seq_len].transpose(0, 1)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None],
                                           attn_mask=mask, scale=scale)
        return o[0].transpose(0, 1)

    def folded() -> torch.Tensor:
        return backend.forward(q, unused, unused, k_cache, v_cache, meta, scale)

    torch.testing.assert_close(folded(), per_head_copy(), atol=1e-5, rtol=1e-5)
    f_ms, c_ms = (median_s(fn, args.reps) * 1e3 for fn in (folded, per_head_copy))
    return PrefillAttentionPoint(q_len, seq_len, f_ms, c_ms, c_ms / f_ms)


def run(args) -> list[PrefillAttentionPoint]:
    shapes = _shapes(args.shapes)
    if args.reps < 1 or args.num_kv_heads < 1 or args.num_heads % args.num_kv_heads:
        raise ValueError("need --reps >= 1 and --num-heads a multiple of --num-kv-heads")
    gen = torch.Generator().manual_seed(0)
    return [_point(args, q_len, seq_len, gen) for q_len, seq_len in shapes]


def main(args: argparse.Namespace) -> int:
    points = run(args)
    if args.json:
        print(json.dumps({"threads": torch.get_num_threads(),
                          "points": [asdict(p) for p in points]}))
        return 0
    print(f"{args.num_heads} query heads over {args.num_kv_heads} KV heads, head size "
          f"{args.head_size}, {torch.get_num_threads()} threads; median of {args.reps}")
    print("| chunk tokens | context | folded (backend) ms | per-head K/V copy ms | speed-up |")
    print("|---|---|---|---|---|")
    for p in points:
        print(f"| {p.query_len} | {p.seq_len} | {p.folded_ms:.3f} | {p.per_head_copy_ms:.3f} | "
              f"**{p.speedup:.2f}x** |")
    return 0
