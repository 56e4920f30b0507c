"""Which bytes move where: layout checks and the descriptor lists of a pull.

A rank's cache is ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]``. When
both sides hold the same KV heads, a block (every layer, K and V) is one contiguous run on each
side, and so is a run of neighbouring blocks: a pull is at most ``num_blocks`` descriptors.
Under heterogeneous TP (prefill TP=k, decode TP=m) a remote rank holds a different head range
than the local rank; its heads then land in a slice of each local token row, so the runs are
per (block, layer, K/V, token).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.kv_layout import KVCacheLayout
from kvtransfer.errors import LayoutMismatchError
from kvtransfer.handle import KVAgentHandle

_SHARED_FIELDS = ("order", "num_layers", "block_size", "head_size", "dtype", "total_num_kv_heads")


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
    # At most one id per block of the cache (a repeat is allowed): an owner must never gather
    # more than its cache holds for one request (block 0 asked for 40,000 times took 1.3 GB).
    if len(ids) > num_blocks:
        raise ValueError(f"{len(ids)} {side} block ids, more than the {num_blocks} blocks "
                         f"of the {side} cache")
    if not all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids):
        raise ValueError(f"{side} block ids must be integers, got {list(ids)[:8]}")
    try:
        arr = np.asarray(list(ids), dtype=np.int64).reshape(-1)
    except OverflowError:  # 2**63 and up: out of range like any other id past the cache
        arr = None
    if arr is None or arr.size and (arr.min() < 0 or arr.max() >= num_blocks):
        raise ValueError(f"{side} block ids must be in [0, {num_blocks}), got {list(ids)[:8]}...")
    return arr


@dataclass(frozen=True)
class PullJob:
    """What one remote rank contributes to a pull: its heads [head_start, +num_heads) of
    ``remote_ids`` land in the same heads of ``local_ids`` here."""

    remote_index: int
    remote: KVAgentHandle
    head_start: int
    num_heads: int
    remote_ids: np.ndarray
    local_ids: np.ndarray
    # Both sides hold exactly these heads: a (layer, K/V, block) is one contiguous run.
    whole_rows: bool

    @property
    def num_bytes(self) -> int:
        lay = self.remote.layout
        return (2 * lay.num_layers * len(self.local_ids) * lay.block_size * self.num_heads
                * lay.head_size * lay.element_size)


def plan_pull(local: KVCacheLayout, backend: str, remotes: list[KVAgentHandle],
              remote_block_ids: list[int], local_block_ids: list[int]) -> list[PullJob]:
    """Every check a pull needs, before any byte moves; the per-remote-rank jobs."""
    if not remotes:
        raise ValueError("no remote ranks to pull from")
    for r in remotes:
        if not isinstance(r, KVAgentHandle):
            raise ValueError(f"remotes must be KVAgentHandle, got {type(r).__name__}")
        if r.backend != backend:
            raise ValueError(f"remote {r.agent_name!r} uses backend {r.backend!r}; this agent "
                             f"uses {backend!r}")
    _check_rank_order(remotes)
    if len(remote_block_ids) != len(local_block_ids):
        raise ValueError(f"{len(remote_block_ids)} remote blocks but "
                         f"{len(local_block_ids)} local blocks")
    local_ids = check_block_ids(local_block_ids, local.num_blocks, "local")
    if len(np.unique(local_ids)) != len(local_ids):
        raise ValueError(f"local block ids repeat: {list(local_block_ids)[:8]}...")
    slices = plan_heads(local, [r.layout for r in remotes])
    jobs = []
    for sl in slices:
        remote = remotes[sl.remote_index]
        rids = check_block_ids(remote_block_ids, remote.layout.num_blocks, "remote")
        whole = sl.num == local.num_kv_heads == remote.layout.num_kv_heads
        jobs.append(PullJob(sl.remote_index, remote, sl.start, sl.num, rids, local_ids, whole))
    return jobs


def _check_rank_order(remotes: list[KVAgentHandle]) -> None:
    """The remotes are every rank of one engine, rank i at position i: the release goes to
    remotes[0], the lease's holder, and to another rank it reached an agent nobody polls,
    leaving the blocks leased until the lease expired."""
    names = [r.agent_name for r in remotes]
    if len(set(names)) != len(names):
        raise ValueError(f"remote ranks repeat an agent: {names}")
    for i, r in enumerate(remotes):
        if r.layout.tp_size != len(remotes) or r.layout.tp_rank != i:
            raise ValueError(f"remote {i} ({r.agent_name!r}) is rank {r.layout.tp_rank} of "
                             f"{r.layout.tp_size}; a pull needs all {len(remotes)} ranks of "
                             "one engine in rank order")


def block_runs(remote_ids: np.ndarray, local_ids: np.ndarray,
               max_blocks: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs where both sides' block ids step by one: (remote starts, local starts,
    lengths), no run longer than ``max_blocks`` (so a pull split over threads has runs to
    share out). A fresh allocation hands out neighbouring blocks, so a prompt's blocks are
    often one run on both sides, and one descriptor can then cover many blocks."""
    n = len(local_ids)
    if n == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty
    breaks = (np.diff(remote_ids) != 1) | (np.diff(local_ids) != 1)
    if max_blocks is not None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        starts = np.flatnonzero(np.concatenate(([True], breaks)))
        # Position of each block inside its maximal run; a cut every max_blocks of them.
        run_start = starts[np.searchsorted(starts, np.arange(n), side="right") - 1]
        breaks = breaks | ((np.arange(1, n) - run_start[1:]) % max_blocks == 0)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, n))
    return remote_ids[starts], local_ids[starts], lengths


def descriptors(layout: KVCacheLayout, base: int, block_ids: np.ndarray, head_start: int,
                num_heads: int, device_id: int, per_token: bool,
                run_blocks: np.ndarray | None = None) -> np.ndarray:
    """``[n, 3]`` uint64 (address, length, device) of the runs, in (block[, layer, kv, token])
    order so both sides of a pull list matching runs at the same index. Whole rows: one run
    per block (all its layers, K and V), or per run of ``run_blocks`` neighbouring blocks
    starting at each of ``block_ids``. Per token: this rank's slice of heads in each token
    row of each (block, layer, K/V)."""
    el = layout.element_size
    row = layout.num_kv_heads * layout.head_size * el  # one token of this rank's heads
    plane = layout.block_size * row  # one (layer, K/V) of one block
    starts = block_ids.astype(np.uint64) * np.uint64(layout.bytes_per_block)
    if per_token:
        head_off = (head_start - layout.kv_head_start) * layout.head_size * el
        planes = np.arange(layout.num_layers * 2, dtype=np.uint64) * np.uint64(plane)
        tokens = np.arange(layout.block_size, dtype=np.uint64) * np.uint64(row)
        starts = (starts[:, None, None] + planes[None, :, None] + tokens[None, None, :]
                  + np.uint64(head_off))
        length = num_heads * layout.head_size * el
    elif run_blocks is not None:
        length = run_blocks.astype(np.uint64) * np.uint64(layout.bytes_per_block)
    else:
        length = layout.bytes_per_block
    addrs = starts.reshape(-1) + np.uint64(base)
    out = np.empty((addrs.size, 3), dtype=np.uint64)
    out[:, 0] = addrs
    out[:, 1] = length
    out[:, 2] = device_id
    return out


def split_runs(lengths: np.ndarray, k: int) -> list[slice]:
    """``k`` consecutive index ranges over runs of ``lengths`` bytes, each close to 1/k of the
    bytes (a run is never cut, so a range may be empty when a few runs hold most bytes)."""
    if not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    before = np.concatenate(([0], np.cumsum(np.asarray(lengths, dtype=np.float64))))
    n = len(before) - 1
    if n == 0:
        return [slice(0, 0)] * k
    targets = before[-1] * np.arange(1, k) / k
    hi = np.clip(np.searchsorted(before, targets), 1, n)
    # The run boundary nearest each target, never moving backwards.
    cut = np.where(targets - before[hi - 1] <= before[hi] - targets, hi - 1, hi)
    bounds = [0, *np.maximum.accumulate(cut).tolist(), n]
    return [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
