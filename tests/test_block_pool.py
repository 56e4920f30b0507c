"""Block hashing, the free queue and the block pool."""
from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
import pytest

from engine import block_hash
from engine.block_hash import (ROOT_BLOCK_HASH, hash_block_tokens, hash_request_tokens)
from engine.block_pool import BlockPool, BlockRemoved, BlockStored, FreeBlockQueue, KVBlock

def h(i: int) -> bytes:
    """A distinct 16-byte stand-in hash."""
    return i.to_bytes(16, "little")


# -- hashing ---------------------------------------------------------------------------------


def test_hash_pinned_values():
    # Pinned: the router and other processes must agree on these bytes forever.
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert ROOT_BLOCK_HASH.hex() == "ec40a6576414e0697a5df5ddf77139a6"
    assert first.hex() == "47437ecebc4dce8b0fd054a886e52555"
    assert hash_block_tokens(first, [5, 6, 7, 8]).hex() == "372d91fdbc44a5ef8ff67c3b0252d9ed"
    assert hash_block_tokens(None, [1, 2, 3, 4], b"lora-1").hex() == \
        "75550fd036b2e28d3fed09b3658a7cc2"


def test_hash_matches_documented_layout():
    tokens = [7, 0, 2**32 - 1, 65536]
    parent = hash_block_tokens(None, [9])
    expected = hashlib.sha256(parent + struct.pack("<I", 4) + struct.pack("<4I", *tokens)
                              + b"salt").digest()[:16]
    assert hash_block_tokens(parent, tokens, b"salt") == expected


def test_hash_chaining_and_keys():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [3, 4])
    assert len(a) == 16
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(None, [5, 6])
    assert hash_block_tokens(None, [1, 2], b"x") != a
    # The token count separates tokens from the extra key.
    assert hash_block_tokens(None, [1]) != hash_block_tokens(None, [], b"\x01\x00\x00\x00")


def test_hash_request_tokens_chains_full_blocks_only():
    tokens = list(range(100, 111))  # 2 full blocks of 4 and a partial one
    hashes = hash_request_tokens(tokens, 4, extra_key=b"k")
    first = hash_block_tokens(None, tokens[0:4], b"k")
    assert hashes == [first, hash_block_tokens(first, tokens[4:8], b"k")]
    assert hash_request_tokens(tokens[:3], 4) == []
    # Continuing a chain from a parent gives the same hashes as hashing all at once.
    whole = hash_request_tokens(tokens, 2)
    assert whole[:2] + hash_request_tokens(tokens[4:], 2, parent=whole[1]) == whole


def test_hash_rejects_bad_input():
    with pytest.raises(ValueError, match="token ids"):
        hash_block_tokens(None, [-1])
    with pytest.raises(ValueError, match="token ids"):
        hash_request_tokens([2**32], 1)
    with pytest.raises(ValueError, match="parent"):
        hash_block_tokens(b"short", [1])
    with pytest.raises(ValueError, match="block_size"):
        hash_request_tokens([1, 2], 0)


def test_hash_independent_of_pythonhashseed():
    # Load the module by path so the child needs nothing else from the package.
    code = ("import importlib.util as u, sys;"
            "s = u.spec_from_file_location('block_hash', sys.argv[1]);"
            "m = u.module_from_spec(s); s.loader.exec_module(m);"
            "print(b''.join(m.hash_request_tokens(list(range(64)), 16, extra_key=b'e')).hex())")
    outputs = set()
    for seed in ("0", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code, block_hash.__file__], env=env,
                              capture_output=True, text=True, check=True)
        outputs.add(proc.stdout.strip())
    outputs.add(b"".join(hash_request_tokens(list(range(64)), 16, extra_key=b"e")).hex())
    assert len(outputs) == 1


# -- free queue ------------------------------------------------------------------------------


def test_free_queue_order_and_middle_removal():
    blocks = [KVBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert [b.block_id for b in q] == [0, 1, 2, 3, 4] and len(q) == 5
    q.remove(blocks[2])
    assert not blocks[2].in_free_queue
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert [b.block_id for b in q] == [1, 3, 4, 2, 0] and len(q) == 5
    with pytest.raises(RuntimeError, match="already in the free queue"):
        q.append(blocks[3])
    for _ in range(5):
        q.popleft()
    with pytest.raises(RuntimeError, match="empty"):
        q.popleft()
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[1])


# -- block pool ------------------------------------------------------------------------------


def test_get_new_blocks_and_free_return_to_tail():
    pool = BlockPool(4, enable_caching=True, block_size=2)
    a = pool.get_new_blocks(2)
    assert [b.block_id for b in a] == [0, 1] and all(b.ref_cnt == 1 for b in a)
    assert pool.num_free_blocks == 2
    pool.free_blocks(a)
    assert [b.block_id for b in pool.free_queue] == [2, 3, 0, 1]
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="only 4 free"):
        pool.get_new_blocks(5)


def test_double_free_raises():
    pool = BlockPool(2)
    (b,) = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.num_free_blocks == 2


def test_touch_reclaims_free_cached_block_and_shares():
    pool = BlockPool(3, enable_caching=True, block_size=2)
    (b,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(b, h(1))
    pool.free_blocks([b])
    assert pool.num_free_blocks == 3 and b.in_free_queue
    assert pool.get_cached_block(h(1)) is b
    pool.touch([b])
    pool.touch([b])
    assert b.ref_cnt == 2 and not b.in_free_queue and pool.num_free_blocks == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and not b.in_free_queue
    pool.free_blocks([b])
    assert b.in_free_queue and b.block_hash == h(1)


def test_eviction_is_lru_and_emits_events():
    pool = BlockPool(3, enable_caching=True, block_size=2)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_block(blocks[0], h(10), None, [1, 2])
    pool.cache_full_block(blocks[1], h(11), h(10), [3, 4])
    pool.cache_full_block(blocks[2], h(12), None)
    events = pool.take_events()
    # The chain 10 -> 11 merges into one event; 12 starts a new chain.
    assert events == [BlockStored([h(10), h(11)], None, [1, 2, 3, 4], 2),
                      BlockStored([h(12)], None, None, 2)]
    assert pool.take_events() == []
    # Freed order: 1, then 2, then 0; so 1 is the least recently freed.
    pool.free_blocks([blocks[1], blocks[2]])
    pool.free_blocks([blocks[0]])
    (x,) = pool.get_new_blocks(1)
    assert x is blocks[1] and x.block_hash is None and x.ref_cnt == 1
    assert pool.get_cached_block(h(11)) is None
    assert pool.get_cached_block(h(10)) is blocks[0]
    assert pool.num_evictions == 1
    pool.get_new_blocks(2)
    assert pool.num_evictions == 3 and pool.num_cached_blocks == 0
    assert pool.take_events() == [BlockRemoved([h(11), h(12), h(10)])]


def test_duplicate_hash_keeps_first_mapping():
    pool = BlockPool(2, enable_caching=True, block_size=2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, h(5))
    assert not pool.cache_full_block(b, h(5))
    assert pool.get_cached_block(h(5)) is a and b.block_hash is None
    assert not pool.cache_full_block(a, h(5))  # re-registering the same mapping is a no-op
    with pytest.raises(RuntimeError, match="another hash"):
        pool.cache_full_block(a, h(6))
    assert len(pool.take_events()) == 1


def test_cache_full_block_checks():
    pool = BlockPool(2, enable_caching=True, block_size=2)
    (a,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError, match="full block has 2 tokens"):
        pool.cache_full_block(a, h(1), None, [1])
    pool.free_blocks([a])
    with pytest.raises(RuntimeError, match="nobody holds"):
        pool.cache_full_block(a, h(1))


def test_caching_disabled_records_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, h(1))
    assert pool.get_cached_block(h(1)) is None and a.block_hash is None
    pool.free_blocks([a])
    pool.get_new_blocks(2)
    assert pool.take_events() == [] and pool.num_evictions == 0


def test_reset_prefix_cache():
    pool = BlockPool(2, enable_caching=True, block_size=1)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(1))
    pool.cache_full_block(b, h(2))
    pool.free_blocks([a])
    pool.take_events()
    assert not pool.reset_prefix_cache()
    assert pool.get_cached_block(h(1)) is a
    pool.free_blocks([b])
    assert pool.reset_prefix_cache()
    assert pool.num_cached_blocks == 0 and a.block_hash is None and b.block_hash is None
    assert pool.take_events() == [BlockRemoved([h(1), h(2)])]
    assert pool.num_free_blocks == 2
    pool.get_new_blocks(2)
    assert pool.num_evictions == 0


def test_bad_pool_arguments():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, block_size=0)
