"""Paged attention in plain PyTorch: the CPU path, and the fallback on any device.

Decodes are batched: their contexts are gathered block by block into a padded
[n, num_kv_heads, L, head_size] tensor and attended with one SDPA call per chunk, masked by
sequence length. Chunks are sized so the gathered K/V stays cache-resident on a CPU (on the
tiny-model benchmark, 64 decodes with 400-800-token contexts, a whole decode step is ~3x faster
than with one chunk), and decodes are sorted by length so a chunk pads little. Prefill chunks
run one sequence at a time; a chunk with no cached prefix attends to its fresh K/V directly.

Everything that depends only on the batch layout (block ids to gather, masks) is built once per
step and reused by every layer, keyed by the identity of the metadata object: a runner must
build a new AttentionMetadata per step rather than mutate the previous one.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kernels.attention_backend import AttentionBackend, AttentionMetadata
from kernels.input_checks import (check_block_size, check_index_bounds, check_query_lens,
                                  index_bounds)

# Gathered K+V bytes per decode chunk. ~4 MiB keeps a chunk in a CPU's L2/L3; on accelerators
# one big batch is better.
CPU_DECODE_CHUNK_BYTES = 4 << 20
DEVICE_DECODE_CHUNK_BYTES = 1 << 30


@dataclass
class _DecodeChunk:
    rows: torch.Tensor  # [n] int64: token rows (= sequence indices) of these decodes
    block_ids: torch.Tensor  # [n * num_blocks] int64: each decode's first num_blocks blocks
    num_blocks: int
    # [n, 1, 1, num_blocks * block_size] additive (0 / -inf); None: no padding
    mask: torch.Tensor | None
    # [n, 1, num_blocks * block_size, 1] True at the padding (None: none). Its gathered K/V
    # are zeroed: they are stale slots, or another request's (block 0 pads short tables), and
    # a non-finite value there would make the masked score NaN (inf + -inf, 0 * inf).
    hidden: torch.Tensor | None = None


@dataclass
class _PrefillSeq:
    start: int  # first token row
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # [ceil(seq_len / block_size)] int64; None: no prefix
    mask: torch.Tensor | None  # [query_len, seq_len] additive (0 / -inf); None: plain causal
    # The mask repeated per query head of a KV head's group, by group size: built by the
    # first layer that asks, reused by the rest of the step's layers.
    group_masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def grouped_mask(self, group: int) -> torch.Tensor:
        """[group * query_len, seq_len]: row g * query_len + j is query j's mask."""
        mask = self.group_masks.get(group)
        if mask is None:
            mask = self.group_masks[group] = self.mask.repeat(group, 1)
        return mask


@dataclass
class _StepPlan:
    # Rows of valid slots when some slots are negative (skipped); None: all tokens written.
    write_rows: torch.Tensor | None
    slots: torch.Tensor  # [num_written] int64: the written tokens' cache slots
    block_size: int
    decode_chunks: list[_DecodeChunk]
    prefills: list[_PrefillSeq]
    # Whether decode_chunks were planned: a CPU backend layer whose caches the kernels cannot
    # read falls back to the torch path, which needs them.
    decodes_gathered: bool = False

    @functools.cached_property
    def slot_index(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each written token goes, as (block, offset in block): [num_written] int64
        each. A layer's cache view has a block stride wider than a block (the cache is
        block-major), so slots cannot index a flattened view. Built on first use: a backend
        that writes K/V with a compiled kernel never needs it."""
        return (torch.div(self.slots, self.block_size, rounding_mode="floor"),
                self.slots.remainder(self.block_size))


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, decode_chunk_bytes: int | None = None) -> None:
        self.decode_chunk_bytes = decode_chunk_bytes
        # (meta, plan) of the last step: every layer of a step passes the same meta object.
        self._cached: tuple[AttentionMetadata | None, _StepPlan | None] = (None, None)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float) -> torch.Tensor:
        plan = self._step_plan(meta, k_cache, query.dtype, gather_decodes=True)
        _write_kv(key, value, k_cache, v_cache, plan)
        out = torch.empty_like(query)  # [num_tokens, num_heads, head_size]
        for chunk in plan.decode_chunks:
            _decode_attention(query, k_cache, v_cache, chunk, scale, out)
        self._prefill(query, key, value, k_cache, v_cache, plan, scale, out)
        return out

    def _prefill(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, plan: _StepPlan, scale: float,
                 out: torch.Tensor) -> None:
        for seq in plan.prefills:
            _prefill_attention(query, key, value, k_cache, v_cache, seq, scale, out)

    def _step_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype,
                   gather_decodes: bool, ranges_checked: bool = False) -> _StepPlan:
        """The step's plan, built by its first layer; ``gather_decodes`` False leaves the
        decodes to a kernel that reads the cache in place; ``ranges_checked``: the caller
        has checked the step's slots, block ids and lengths against the cache."""
        cached_meta, plan = self._cached
        if cached_meta is not meta or plan is None or plan.decodes_gathered != gather_decodes:
            plan = self._make_plan(meta, k_cache, dtype, gather_decodes, ranges_checked)
            self._cached = (meta, plan)
        return plan

    def _make_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor, dtype: torch.dtype,
                   gather_decodes: bool, ranges_checked: bool) -> _StepPlan:
        # ranges_checked does not skip this path's own checks: torch indexing needs them, and
        # the bounds cost no extra sync (the write reads the smallest slot anyway).
        check_block_size(meta, k_cache.shape[1])
        check_query_lens(meta)
        bounds = index_bounds(meta.slot_mapping, meta.block_tables)
        check_index_bounds(bounds, k_cache.shape[0], k_cache.shape[1])
        slots = meta.slot_mapping.long()
        write_rows = None
        if bounds.slot_min < 0:
            write_rows = torch.nonzero(slots >= 0).squeeze(1)
            slots = slots.index_select(0, write_rows)
        budget = self.decode_chunk_bytes
        if budget is None:
            budget = (CPU_DECODE_CHUNK_BYTES if k_cache.device.type == "cpu"
                      else DEVICE_DECODE_CHUNK_BYTES)
        # Bytes of gathered K and V per context token.
        token_bytes = 2 * k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        block_tables = meta.block_tables.long()
        needed = -(-max(meta.seq_lens_list, default=0) // meta.block_size)
        if block_tables.shape[-1] < needed:
            raise ValueError(f"block_tables has {block_tables.shape[-1]} columns; the longest "
                             f"sequence needs {needed} blocks")
        if any(n != 1 for n in meta.query_lens_list[:meta.num_decodes]):
            raise ValueError("the first num_decodes sequences must have query length 1")
        decodes = (_plan_decodes(meta, block_tables, max(budget // token_bytes, 1), dtype)
                   if gather_decodes else [])
        return _StepPlan(write_rows, slots, k_cache.shape[1], decodes,
                         _plan_prefills(meta, block_tables, dtype), gather_decodes)


def _additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # SDPA would convert a boolean mask to this on every call; once per step is enough.
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(
        ~visible, float("-inf"))


def _plan_decodes(meta: AttentionMetadata, block_tables: torch.Tensor, token_budget: int,
                  dtype: torch.dtype) -> list[_DecodeChunk]:
    nd = meta.num_decodes
    bs = meta.block_size
    lens = meta.seq_lens_list
    # Sorted by context length, a chunk's padded size is close to its real size.
    order = sorted(range(nd), key=lens.__getitem__)
    device = block_tables.device
    chunks = []
    i = 0
    while i < nd:
        j = i + 1
        while j < nd and (j + 1 - i) * lens[order[j]] <= token_budget:
            j += 1
        members = order[i:j]
        num_blocks = -(-lens[members[-1]] // bs)
        rows = torch.tensor(members, dtype=torch.int64, device=device)
        block_ids = block_tables.index_select(0, rows)[:, :num_blocks].reshape(-1)
        mask = None
        if any(lens[m] != num_blocks * bs for m in members):
            positions = torch.arange(num_blocks * bs, device=device)
            seq_lens = meta.seq_lens.index_select(0, rows)
            visible = positions[None, :] < seq_lens[:, None]
            mask = _additive_mask(visible, dtype)[:, None, None, :]
            hidden = ~visible[:, None, :, None]
        chunks.append(_DecodeChunk(rows, block_ids, num_blocks, mask,
                                   hidden if mask is not None else None))
        i = j
    return chunks


def _plan_prefills(meta: AttentionMetadata, block_tables: torch.Tensor,
                   dtype: torch.dtype) -> list[_PrefillSeq]:
    bs = meta.block_size
    device = block_tables.device
    seqs = []
    start = meta.num_decodes
    for i in range(meta.num_decodes, meta.num_seqs):
        q_len, seq_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        end = start + q_len
        if q_len == 0:
            continue
        if q_len == seq_len:
            seqs.append(_PrefillSeq(start, end, seq_len, None, None))
        else:
            # Query j sits at position seq_len - q_len + j and sees positions up to it.
            q_pos = torch.arange(seq_len - q_len, seq_len, device=device)
            visible = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]
            mask = _additive_mask(visible, dtype)
            block_ids = block_tables[i, :-(-seq_len // bs)]
            seqs.append(_PrefillSeq(start, end, seq_len, block_ids, mask))
        start = end
    return seqs


def _write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
              v_cache: torch.Tensor, plan: _StepPlan) -> None:
    if plan.write_rows is not None:
        key = key.index_select(0, plan.write_rows)
        value = value.index_select(0, plan.write_rows)
    index = plan.slot_index
    k_cache.index_put_(index, key)  # k_cache[block, offset] = key[i]: [num_kv_heads, head_size]
    v_cache.index_put_(index, value)


def write_kv_by_slots(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """The torch path's K/V write for one slot mapping (negative slots skipped), outside a
    step plan: the reference the compiled writes are tested against."""
    slots = slot_mapping.long()
    write_rows = torch.nonzero(slots >= 0).squeeze(1)
    plan = _StepPlan(write_rows, slots.index_select(0, write_rows), k_cache.shape[1], [], [])
    _write_kv(key, value, k_cache, v_cache, plan)


def _gather(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    # [len(block_ids) * block_size, num_kv_heads, head_size]
    return cache.index_select(0, block_ids).view(-1, *cache.shape[2:])


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      chunk: _DecodeChunk, scale: float, out: torch.Tensor) -> None:
    n = chunk.rows.shape[0]
    _, num_heads, head_size = query.shape
    num_kv_heads = k_cache.shape[2]
    # Query heads that share a KV head become that head's G queries: [n, kv_heads, G, head_size]
    q = query.index_select(0, chunk.rows).view(n, num_kv_heads, -1, head_size)
    k = _gather(k_cache, chunk.block_ids).view(n, -1, num_kv_heads, head_size).transpose(1, 2)
    v = _gather(v_cache, chunk.block_ids).view(n, -1, num_kv_heads, head_size).transpose(1, 2)
    if chunk.hidden is not None:
        k = k.masked_fill(chunk.hidden, 0.0)
        v = v.masked_fill(chunk.hidden, 0.0)
    o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale)
    out.index_copy_(0, chunk.rows, o.reshape(n, num_heads, head_size))


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, seq: _PrefillSeq,
                       scale: float, out: torch.Tensor) -> None:
    q = query[seq.start:seq.end].transpose(0, 1)  # [num_heads, q_len, head_size]
    num_heads, q_len, head_size = q.shape
    if seq.block_ids is None:  # no cached prefix: the fresh K/V is the whole context
        k = key[seq.start:seq.end].transpose(0, 1)  # [num_kv_heads, q_len, head_size]
        v = value[seq.start:seq.end].transpose(0, 1)
        group = num_heads // k.shape[0]
        if group > 1:
            # SDPA's enable_gqa sends CPU calls down the unfused math path (the whole score
            # matrix, causal half included): 10-50x slower than the flash kernel it takes
            # when each query head has its own K/V. The copy is one chunk's fresh K/V.
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True,
                                           scale=scale)[0]
    else:
        # [num_kv_heads, seq_len, head_size]
        k = _gather(k_cache, seq.block_ids)[:seq.seq_len].transpose(0, 1)
        v = _gather(v_cache, seq.block_ids)[:seq.seq_len].transpose(0, 1)
        group = num_heads // k.shape[0]
        # The query heads sharing a KV head become one longer query over it (the mask, which
        # a cached prefix needs anyway, repeated per head), rather than a copy of the whole
        # context's K/V per query head: 1.2-1.5x faster for 16-512-token chunks over 1-2K
        # contexts, and bit for bit the same.
        q = q.reshape(k.shape[0], group * q_len, head_size)
        o = F.scaled_dot_product_attention(q[None], k[None], v[None],
                                           attn_mask=seq.grouped_mask(group), scale=scale)
        o = o[0].reshape(num_heads, q_len, head_size)  # a view where SDPA left it contiguous
    out[seq.start:seq.end] = o.transpose(0, 1)
