"""KVCacheManager: block tables, prefix-cache hits, allocation failure and events."""
from __future__ import annotations

import pytest

from engine.block_hash import hash_request_tokens
from engine.block_pool import BlockRemoved, BlockStored
from engine.kv_cache_manager import ComputedBlocks, KVCacheManager
from engine.outputs import PrefixCacheReset
from engine.request import Request
from engine.sampling_params import SamplingParams


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=64))


def prefill(mgr: KVCacheManager, req: Request) -> list[int] | None:
    """Schedules the whole uncached rest of the prompt, as the scheduler would."""
    computed = mgr.get_computed_blocks(req)
    new_ids = mgr.allocate_slots(req, req.num_tokens - computed.num_computed_tokens, computed)
    if new_ids is not None:
        req.num_computed_tokens = req.num_tokens
    return new_ids


def pool_snapshot(mgr: KVCacheManager) -> tuple:
    pool = mgr.pool
    return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
            [b.block_hash for b in pool.blocks], dict(pool.cached_blocks),
            pool.num_evictions, len(pool._events))


def test_allocate_caches_full_blocks_and_emits_events():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    assert prefill(mgr, a) == [0, 1, 2]
    assert mgr.get_block_ids("a") == [0, 1, 2]
    assert mgr.num_free_blocks == 5
    assert mgr.usage == pytest.approx(3 / 8)
    hashes = hash_request_tokens(list(range(10)), 4)
    assert [mgr.pool.blocks[i].block_hash for i in range(3)] == hashes + [None]
    assert mgr.take_events() == [BlockStored(hashes, None, None, 4)]


def test_prefix_hit_shares_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    prefill(mgr, a)
    b = make_request("b", list(range(8)) + [50, 51, 52])
    computed = mgr.get_computed_blocks(b)
    assert computed.block_ids == [0, 1] and computed.num_computed_tokens == 8
    assert mgr.allocate_slots(b, 3, computed) == [3]
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert [blk.ref_cnt for blk in mgr.pool.blocks[:4]] == [2, 2, 1, 1]
    assert mgr.stats.requests == 2 and mgr.stats.queries == 21 and mgr.stats.hits == 8
    assert mgr.stats.hit_rate == pytest.approx(8 / 21)


def test_hit_never_covers_the_whole_request():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    prefill(mgr, make_request("a", list(range(12))))
    # 8 tokens, both blocks cached: the last block is dropped so a token remains to compute.
    assert mgr.get_computed_blocks(make_request("b", list(range(8)))).num_computed_tokens == 4
    assert mgr.get_computed_blocks(make_request("c", list(range(9)))).num_computed_tokens == 8
    assert mgr.get_computed_blocks(make_request("d", list(range(4)))).num_computed_tokens == 0
    assert mgr.get_computed_blocks(make_request("e", [0, 1, 2, 9, 9])).num_computed_tokens == 0


def test_failed_allocation_with_reclaimed_computed_blocks_changes_nothing():
    # Pool of 4: a caches blocks 0..2 and leaves; they stay free and cached.
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", list(range(6)))
    prefill(mgr, a)
    mgr.free(a)
    assert mgr.num_free_blocks == 4
    # b hits all 3 (free) blocks and needs 2 more: 4 look free but only 1 is left once the
    # hits are touched.
    b = make_request("b", list(range(6)) + [7, 8, 9])
    computed = mgr.get_computed_blocks(b)
    assert computed.block_ids == [0, 1, 2]
    before = pool_snapshot(mgr)
    assert mgr.allocate_slots(b, 3, computed) is None
    assert pool_snapshot(mgr) == before
    assert mgr.get_block_ids("b") == []
    # One block short of that fits.
    c = make_request("c", list(range(6)) + [7, 8])
    computed = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 2, computed) == [3]
    assert mgr.get_block_ids("c") == [0, 1, 2, 3] and mgr.num_free_blocks == 0


def test_decode_growth_hashes_incrementally_and_caches_filled_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    req = make_request("r", [5, 6, 7])
    prefill(mgr, req)
    mgr.take_events()
    new_ids_per_step = []
    for tok in range(100, 110):
        req.append_output_token(tok)  # sampled token; its K/V is computed next step
        new_ids_per_step.append(mgr.allocate_slots(req, 1))
        req.num_computed_tokens += 1
    # 13 tokens in 4 blocks: a new block each time the table fills.
    assert [len(ids) for ids in new_ids_per_step] == [0, 1, 0, 0, 0, 1, 0, 0, 0, 1]
    assert len(mgr.get_block_ids("r")) == 4
    expected = hash_request_tokens(req.all_token_ids, 4)
    assert mgr._req_hashes["r"] == expected
    assert [mgr.pool.blocks[i].block_hash for i in mgr.get_block_ids("r")[:3]] == expected
    # Blocks filled one at a time still publish one chain.
    assert mgr.take_events() == [BlockStored(expected, None, None, 4)]


def test_decode_role_caches_after_external_write():
    mgr = KVCacheManager(num_blocks=8, block_size=4, event_token_ids=True)
    req = make_request("r", list(range(9)))
    assert mgr.allocate_slots(req, 9, cache_blocks=False) == [0, 1, 2]
    assert mgr.pool.num_cached_blocks == 0 and mgr.take_events() == []
    with pytest.raises(ValueError, match="has 9"):
        mgr.cache_blocks(req, 10)
    mgr.cache_blocks(req, 9)
    hashes = hash_request_tokens(list(range(9)), 4)
    assert mgr.take_events() == [BlockStored(hashes, None, list(range(8)), 4)]
    other = make_request("o", list(range(9)))
    assert mgr.get_computed_blocks(other).block_ids == [0, 1]


def test_free_releases_tail_first():
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a = make_request("a", list(range(6)))
    prefill(mgr, a)
    mgr.free(a)
    assert [b.block_id for b in mgr.pool.free_queue] == [3, 4, 5, 2, 1, 0]
    # After the 3 never-used blocks, eviction takes a's tail block, keeping its head cached.
    filler = make_request("f", [90] * 8)
    prefill(mgr, filler)
    assert mgr.get_block_ids("f") == [3, 4, 5, 2]
    assert mgr.stats.evictions == 1
    a_hashes = hash_request_tokens(list(range(6)), 2)
    assert BlockRemoved([a_hashes[2]]) in mgr.take_events()
    again = make_request("a2", list(range(6)) + [1])
    assert mgr.get_computed_blocks(again).block_ids == [0, 1]


def test_free_unknown_or_twice_is_noop():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    mgr.free(a)
    prefill(mgr, a)
    mgr.free(a)
    mgr.free(a)
    assert mgr.num_free_blocks == 4 and mgr.get_block_ids("a") == []


def test_identical_concurrent_prompts_keep_first_cached_copy():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 5])
    ca, cb = mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)  # both miss
    mgr.allocate_slots(a, 5, ca)
    mgr.allocate_slots(b, 5, cb)
    assert mgr.get_block_ids("a") == [0, 1, 2] and mgr.get_block_ids("b") == [3, 4, 5]
    assert mgr.pool.blocks[3].block_hash is None and mgr.pool.num_cached_blocks == 2
    mgr.free(a)
    mgr.free(b)
    assert mgr.get_computed_blocks(make_request("c", [1, 2, 3, 4, 5])).block_ids == [0, 1]


def test_preempted_request_hits_its_own_blocks():
    mgr = KVCacheManager(num_blocks=8, block_size=2)
    req = make_request("r", list(range(7)))
    prefill(mgr, req)
    req.append_output_token(99)
    mgr.allocate_slots(req, 1)
    mgr.free(req)  # preempted: the scheduler resets its progress
    req.num_computed_tokens = 0
    computed = mgr.get_computed_blocks(req)
    assert computed.num_computed_tokens == 6  # 8 tokens, all 4 blocks cached; the last dropped
    # The dropped block's tokens are recomputed into a fresh block, which stays uncached
    # because block 3 already holds that hash.
    assert mgr.allocate_slots(req, 2, computed) == [4]
    assert mgr.get_block_ids("r") == [0, 1, 2, 4]
    assert mgr.pool.blocks[4].block_hash is None and mgr.pool.blocks[3].block_hash is not None


def test_caching_disabled():
    mgr = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    a = make_request("a", [1, 2, 3, 4, 5])
    prefill(mgr, a)
    mgr.free(a)
    b = make_request("b", [1, 2, 3, 4, 5])
    assert mgr.get_computed_blocks(b) == ComputedBlocks()
    assert prefill(mgr, b) == [3, 2, 1]
    assert mgr.take_events() == [] and mgr.pool.num_cached_blocks == 0
    assert mgr.stats.requests == 0 and mgr.stats.evictions == 0


def test_reset_prefix_cache():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    assert mgr.reset_prefix_cache() == PrefixCacheReset(False, 0, 2)
    mgr.free(a)
    mgr.take_events()
    assert mgr.reset_prefix_cache() == PrefixCacheReset(True, 1, 0)
    assert mgr.take_events() == [BlockRemoved(hash_request_tokens([1, 2], 2))]
    assert mgr.get_computed_blocks(make_request("b", [1, 2, 3])).num_computed_tokens == 0


def test_misuse_raises():
    mgr = KVCacheManager(num_blocks=4, block_size=2)
    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    with pytest.raises(ValueError, match="already has 3 computed"):
        mgr.get_computed_blocks(a)
    with pytest.raises(ValueError, match="num_new_tokens"):
        mgr.allocate_slots(a, -1)
    b = make_request("b", [1, 2, 3])
    computed = mgr.get_computed_blocks(b)
    with pytest.raises(ValueError, match="does not match"):
        mgr.allocate_slots(b, 1, ComputedBlocks(computed.blocks, 1))
    mgr.allocate_slots(b, 1, computed)
    with pytest.raises(ValueError, match="already started"):
        mgr.allocate_slots(b, 1, computed)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(num_blocks=4, block_size=0)


def test_stale_computed_blocks_are_rejected():
    mgr = KVCacheManager(num_blocks=2, block_size=2)
    a = make_request("a", [1, 2, 3])
    prefill(mgr, a)
    mgr.free(a)
    b = make_request("b", [1, 2, 3])
    computed = mgr.get_computed_blocks(b)
    prefill(mgr, make_request("x", [7, 7, 7, 7]))  # evicts the hit block in between
    with pytest.raises(RuntimeError, match="evicted"):
        mgr.allocate_slots(b, 1, computed)


def test_hit_stops_at_first_miss_even_if_later_blocks_are_cached():
    # Build a cached child whose parent was evicted: b duplicates a's blocks (uncached),
    # then caches its third block under a's chain; a's copies are then evicted.
    mgr = KVCacheManager(num_blocks=6, block_size=2)
    a, b = make_request("a", [1, 2, 3, 4, 5]), make_request("b", [1, 2, 3, 4, 5])
    ca, cb = mgr.get_computed_blocks(a), mgr.get_computed_blocks(b)
    mgr.allocate_slots(a, 5, ca)
    mgr.allocate_slots(b, 5, cb)
    b.num_computed_tokens = 5
    mgr.free(a)
    b.append_output_token(6)
    mgr.allocate_slots(b, 1)  # fills b's third block (id 5), cached under the chain
    assert mgr.pool.blocks[5].block_hash is not None
    prefill(mgr, make_request("filler", [9] * 6))  # takes blocks 2, 1, 0: evicts the parents
    mgr.free(b)
    c = make_request("c", [1, 2, 3, 4, 5, 6, 7])
    hashes = hash_request_tokens(c.all_token_ids, 2)
    assert mgr.pool.get_cached_block(hashes[2]) is mgr.pool.blocks[5]
    assert mgr.get_computed_blocks(c) == ComputedBlocks()


def test_lookup_counted_once_when_admission_is_retried():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(10)))
    prefill(mgr, a)  # holds all 3 blocks
    b = make_request("b", list(range(100, 110)))
    for _ in range(3):  # the scheduler retries each step while the pool is short
        assert mgr.allocate_slots(b, 10, mgr.get_computed_blocks(b)) is None
    assert mgr.stats.requests == 1 and mgr.stats.queries == 10
    mgr.free(a)
    assert mgr.allocate_slots(b, 10, mgr.get_computed_blocks(b)) is not None
    assert mgr.stats.requests == 2 and mgr.stats.queries == 20


def test_token_ids_between_slices_prompt_and_output_as_one_list():
    req = make_request("r", [10, 11, 12, 13])
    for t in (14, 15, 16):
        req.append_output_token(t)
    whole = req.all_token_ids
    for start in range(len(whole) + 1):
        for stop in range(start, len(whole) + 1):
            assert req.token_ids_between(start, stop) == whole[start:stop], (start, stop)


def test_blocks_written_from_outside_survive_the_failure_of_a_step_that_did_not_write_them():
    """A decode worker's committed blocks (KV pulled from the prefill worker) were taken for
    ones the next step computes: that step failing dropped them from the prefix cache (and
    told the routers), and the request never cached them again."""
    kv = KVCacheManager(8, 2)
    d = Request("d", [1, 2, 3, 4], SamplingParams(), output_token_ids=[5])
    kv.allocate_slots(d, 4, kv.get_computed_blocks(d), cache_blocks=False)
    d.num_computed_tokens = 4
    kv.cache_blocks(d, 4)  # its KV landed: commit_prefilled
    other = Request("o", [9, 9, 9], SamplingParams())
    kv.allocate_slots(other, 3, kv.get_computed_blocks(other))
    kv.end_schedule()
    kv.uncache_last_schedule()  # that step failed
    assert [kv.pool.blocks[b].block_hash is not None for b in kv.get_block_ids("d")] == \
        [True, True]


def test_a_preempted_request_readmitted_does_not_count_its_own_blocks_as_hits():
    """It finds the blocks it computed before its preemption: counted again, a request
    preempted a few times read as a high hit rate where nothing else shared its prefix."""
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    assert mgr.allocate_slots(a, 10, mgr.get_computed_blocks(a)) is not None
    a.num_cached_tokens = 0  # the scheduler's, at its first admission
    mgr.free(a)  # preempted
    a.num_computed_tokens = 0
    assert mgr.allocate_slots(a, 2, computed := mgr.get_computed_blocks(a)) is not None
    assert computed.num_computed_tokens == 8  # its own two full blocks
    assert (mgr.stats.requests, mgr.stats.queries, mgr.stats.hits) == (1, 10, 0)
