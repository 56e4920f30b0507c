"""Stable, chained hashes of full KV blocks.

A block's hash names its whole prefix: it covers the parent block's hash, so two blocks match
only if every token before them matches too. The router computes the same hashes in another
process to route requests to the worker that already holds their prefix, so the hash must not
depend on the interpreter (never Python's ``hash()``, which is salted per process).

Byte layout, so that other implementations can reproduce it::

    digest = sha256(parent_or_root || u32le(len(token_ids)) || u32le(token_ids)... || extra_key)
    block_hash = digest[:16]

where ``root = sha256(b"pdserve-kv-block-root-v1")[:16]`` stands in for a missing parent.
The token count makes the split between token ids and ``extra_key`` unambiguous.
"""
from __future__ import annotations

import hashlib
import struct
import sys
from array import array
from collections.abc import Sequence

BlockHash = bytes

BLOCK_HASH_BYTES = 16
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pdserve-kv-block-root-v1").digest()[:BLOCK_HASH_BYTES]

# array("I") is the native unsigned int; we need exactly 4 little-endian bytes per token.
_U32 = "I" if array("I").itemsize == 4 else "L"
_BIG_ENDIAN = sys.byteorder == "big"
_COUNT = struct.Struct("<I")


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32, packed in C rather than per int in Python."""
    try:
        packed = array(_U32, token_ids)
    except (OverflowError, TypeError) as e:
        raise ValueError(f"token ids must be integers in [0, 2**32): {e}") from None
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def _check_parent(parent: BlockHash | None) -> bytes:
    if parent is None:
        return ROOT_BLOCK_HASH
    if not isinstance(parent, bytes) or len(parent) != BLOCK_HASH_BYTES:
        raise ValueError(f"parent block hash must be {BLOCK_HASH_BYTES} bytes, got {parent!r}")
    return parent


def _hash_packed(parent: bytes, packed_tokens: bytes | memoryview, num_tokens: int,
                 extra_key: bytes) -> BlockHash:
    h = hashlib.sha256(parent)
    h.update(_COUNT.pack(num_tokens))
    h.update(packed_tokens)
    h.update(extra_key)
    return h.digest()[:BLOCK_HASH_BYTES]


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      extra_key: bytes = b"") -> BlockHash:
    """Hash of one block given its parent's hash (None for the first block)."""
    return _hash_packed(_check_parent(parent), _pack_tokens(token_ids), len(token_ids), extra_key)


def hash_request_tokens(token_ids: Sequence[int], block_size: int,
                        parent: BlockHash | None = None,
                        extra_key: bytes = b"") -> list[BlockHash]:
    """Chained hashes of the full blocks of ``token_ids``; a trailing partial block is skipped.

    ``parent`` continues an existing chain: pass the hash of the block just before
    ``token_ids[0]`` to hash only the tail of a growing request.
    """
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    num_full = len(token_ids) // block_size
    if num_full == 0:
        return []
    # Pack everything once, then hash zero-copy slices: one C call instead of one per block.
    packed = memoryview(_pack_tokens(token_ids[: num_full * block_size]))
    stride = block_size * 4
    prev = _check_parent(parent)
    hashes: list[BlockHash] = []
    for i in range(num_full):
        prev = _hash_packed(prev, packed[i * stride:(i + 1) * stride], block_size, extra_key)
        hashes.append(prev)
    return hashes
