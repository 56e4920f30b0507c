"""Checks of a step's AttentionMetadata against the paged cache, shared by the backends.

An out-of-range slot or block id is an engine bug, but what it does depends on the backend:
torch indexing raises a bare IndexError (on a GPU, a device-side assert that poisons the CUDA
context), the C kernels and Triton's interpreter read or write outside the cache (heap
corruption, or silently wrong numbers). A query longer than its context is meaningless, and
the kernels return NaN or garbage for it. So each backend checks once per step, here, and
raises a ValueError naming the argument.

The length checks read the host lists and cost no device access. The index checks read
``slot_mapping`` and ``block_tables``: free on the CPU, but a device sync elsewhere, so the
Triton backend runs them on a GPU only with ``PDSERVE_CHECK_KERNEL_INPUTS=1`` (the torch
backend syncs on the slots anyway and checks both in that one transfer).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels.attention_backend import AttentionMetadata

DEBUG_ENV = "PDSERVE_CHECK_KERNEL_INPUTS"


@dataclass(frozen=True)
class IndexBounds:
    """Smallest and largest slot and block id of a step (an empty tensor gives 0, -1)."""

    slot_min: int
    slot_max: int
    block_min: int
    block_max: int


def check_block_size(meta: AttentionMetadata, cache_block_size: int) -> None:
    # Slots and block tables are read in the metadata's block size: another cache's would
    # put every token in the wrong place.
    if meta.block_size != cache_block_size:
        raise ValueError(f"meta.block_size ({meta.block_size}) != the cache's "
                         f"({cache_block_size})")


def check_query_lens(meta: AttentionMetadata) -> None:
    """Every sequence's query length in [0, its seq_len]: its new tokens are the last of its
    context, so a longer query would attend to positions before the sequence's start."""
    query_lens, seq_lens = meta.query_lens_list, meta.seq_lens_list
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"query_lens_list has {len(query_lens)} sequences, seq_lens_list "
                         f"{len(seq_lens)}")
    if all(0 <= q <= s for q, s in zip(query_lens, seq_lens)):
        return
    i = next(i for i, (q, s) in enumerate(zip(query_lens, seq_lens)) if not 0 <= q <= s)
    raise ValueError(f"query_lens_list[{i}] ({query_lens[i]}) must be in [0, seq_lens_list[{i}] "
                     f"({seq_lens[i]})]: a sequence's new tokens are the last of its context")


def index_bounds(slot_mapping: torch.Tensor, block_tables: torch.Tensor) -> IndexBounds:
    """The step's index bounds, in one device-to-host transfer (one sync on a GPU)."""
    stats = []
    for t in (slot_mapping, block_tables):
        if t.numel():
            stats += torch.aminmax(t.reshape(-1))
        else:
            stats += [t.new_zeros(()), t.new_full((), -1)]
    return IndexBounds(*torch.stack([s.long() for s in stats]).tolist())


def check_slot_max(slot_max: int, num_blocks: int, block_size: int) -> None:
    # Negative slots are padding (skipped, not written), so only the top is bounded.
    if slot_max >= num_blocks * block_size:
        raise ValueError(f"slot_mapping: slots must be below {num_blocks * block_size} "
                         f"({num_blocks} blocks of {block_size}), got {slot_max}")


def check_block_range(block_min: int, block_max: int, num_blocks: int) -> None:
    # Tables are padded with block 0, a valid id, so every entry is bounded.
    if block_min < 0 or block_max >= num_blocks:
        raise ValueError(f"block_tables: block ids must be in [0, {num_blocks}), got "
                         f"[{block_min}, {block_max}]")


def check_index_bounds(bounds: IndexBounds, num_blocks: int, block_size: int) -> None:
    check_slot_max(bounds.slot_max, num_blocks, block_size)
    check_block_range(bounds.block_min, bounds.block_max, num_blocks)


def index_checks_affordable(meta: AttentionMetadata) -> bool:
    """Whether reading the step's index tensors costs no device sync (they are on the CPU),
    or the debug flag asks for the checks anyway. Never while a CUDA graph is being captured:
    a sync is not allowed there."""
    if meta.slot_mapping.device.type == "cpu" and meta.block_tables.device.type == "cpu":
        return True
    if os.environ.get(DEBUG_ENV) != "1":
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
