"""Which bytes move where: layout checks and the descriptor lists of a pull.

A rank's cache is ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_size]``. When
both sides hold the same KV heads, one (layer, K/V, block) is one contiguous run on each side,
so a pull is ``num_layers * 2 * num_blocks`` descriptors. Under heterogeneous TP (prefill TP=k,
decode TP=m) a remote rank holds a different head range than the local rank; its heads then
land in a slice of each local token row, so the runs are per (layer, K/V, block, token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_layout import KVCacheLayout
from kvtransfer.errors import LayoutMismatchError

_SHARED_FIELDS = ("num_layers", "block_size", "head_size", "dtype", "total_num_kv_heads")


def check_compatible(local: KVCacheLayout, remote: KVCacheLayout) -> None:
    """Refuses, naming both sides, caches whose blocks cannot be exchanged."""
    for name in _SHARED_FIELDS:
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            raise LayoutMismatchError(
                f"KV layouts differ in {name}: local rank {local.tp_rank}/{local.tp_size} has "
                f"{a!r}, remote rank {remote.tp_rank}/{remote.tp_size} has {b!r}")


@dataclass(frozen=True)
class HeadSlice:
    """Heads [start, start + num) taken from one remote rank."""

    remote_index: int  # into the remotes list
    start: int
    num: int


def plan_heads(local: KVCacheLayout, remotes: list[KVCacheLayout]) -> list[HeadSlice]:
    """For each remote rank that holds heads this rank lacks, the slice it provides."""
    lo, hi = local.kv_head_start, local.kv_head_start + local.num_kv_heads
    covered = np.zeros(local.total_num_kv_heads, dtype=bool)
    slices: list[HeadSlice] = []
    for i, r in enumerate(remotes):
        check_compatible(local, r)
        start, end = max(lo, r.kv_head_start), min(hi, r.kv_head_start + r.num_kv_heads)
        # Replicated heads (TP above the KV head count) are read from the first rank only.
        if end <= start or covered[start:end].all():
            continue
        covered[start:end] = True
        slices.append(HeadSlice(i, start, end - start))
    if not covered[lo:hi].all():
        raise LayoutMismatchError(
            f"remote ranks hold KV heads {[(r.kv_head_start, r.num_kv_heads) for r in remotes]}"
            f" and cannot cover local heads [{lo}, {hi}) of rank {local.tp_rank}")
    return slices


def check_block_ids(ids: list[int], num_blocks: int, side: str) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int64)
    if arr.ndim != 1 or (arr.size and (arr.min() < 0 or arr.max() >= num_blocks)):
        raise ValueError(f"{side} block ids must be in [0, {num_blocks}), got {list(ids)[:8]}...")
    return arr


def descriptors(layout: KVCacheLayout, base: int, block_ids: np.ndarray, head_start: int,
                num_heads: int, device_id: int, per_token: bool) -> np.ndarray:
    """``[n, 3]`` uint64 (address, length, device) of the runs, in (layer, kv, block[, token])
    order so both sides of a pull list matching runs at the same index."""
    el = layout.element_size
    row = layout.num_kv_heads * layout.head_size * el  # one token of this rank's heads
    block = layout.block_size * row
    head_off = (head_start - layout.kv_head_start) * layout.head_size * el
    planes = np.arange(layout.num_layers * 2, dtype=np.uint64) * np.uint64(
        layout.num_blocks * block)
    starts = planes[:, None] + block_ids.astype(np.uint64)[None, :] * np.uint64(block)
    if per_token:
        tokens = np.arange(layout.block_size, dtype=np.uint64) * np.uint64(row)
        starts = starts[:, :, None] + tokens[None, None, :]
        length = num_heads * layout.head_size * el
    else:
        length = block
    addrs = starts.reshape(-1) + np.uint64(base + head_off)
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = device_id
    return out
