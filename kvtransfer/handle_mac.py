"""A KV handle's MAC: what a prefill worker hands out, a decode worker reads only as given.

A decode worker pulls the blocks a handle names and keeps them in its prefix cache under the
prompt its Decode names, so a handle made up by any caller of its port (another lease's
blocks, or a lease's blocks under another prompt) would poison that cache. Each prefill worker
signs its handles with a random key of its own, made at start and published with its rank
handles in the registry, which cluster members read and a router's clients do not reach.

Signed: every field of the handle but ``lease_timeout_s`` (the router lowers it to what is
left of the lease on the way: it bounds the pull, it names no block), and a digest of the
token ids whose KV the blocks hold (the prompt, then a migrated request's resumed output).

The key lives as long as the prefill worker, and a lease's blocks go to other prompts once it
is released or expires, so a handle alone would stay good for the worker's whole life: one
captured off the network and replayed later would have a decode worker read other prompts'
KV into its prefix cache under the handle's prompt. So ``lease_expires_unix_s``, when the
lease ends on the prefill worker's clock, is signed too, and a decode worker reads no handle
past it (decode_svc/kv_sources.py); ``lease_timeout_s``, which anyone on the way may raise,
cannot stretch the read beyond it.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from protos import common_pb2

KEY_BYTES = 32
# v2: the message holds the lease's expiry (v1's did not).
_DOMAIN = b"pdserve.kv_handle.v2"


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def sign(key: bytes, h: common_pb2.KVHandle, token_ids: Sequence[int]) -> bytes:
    """The MAC of ``h`` (its ``mac`` field aside) for the KV of ``token_ids``."""
    return hmac.new(key, _message(h, token_ids), hashlib.sha256).digest()


def verify(key: bytes, h: common_pb2.KVHandle, token_ids: Sequence[int]) -> bool:
    return hmac.compare_digest(sign(key, h, token_ids), h.mac)


def _message(h: common_pb2.KVHandle, token_ids: Sequence[int]) -> bytes:
    """Each field length-prefixed, so no two handles run together into the same bytes."""
    parts = [_DOMAIN, h.worker_id.encode(), h.worker_address.encode(), h.backend.encode(),
             h.lease_id.encode(), struct.pack("<qq", h.num_tokens, h.block_size),
             struct.pack("<d", h.lease_expires_unix_s),
             struct.pack(f"<{len(h.block_ids)}q", *h.block_ids),
             hashlib.sha256(b"".join(_framed(b) for b in h.rank_handles)).digest(),
             hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).digest()]
    return b"".join(_framed(p) for p in parts)


def _framed(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b
