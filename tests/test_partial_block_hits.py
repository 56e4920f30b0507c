"""Partial-block prefix hits: the sibling index, the manager's copies, and the copy itself."""
from __future__ import annotations

import types

import pytest
import torch

from engine.block_pool import BlockPool
from engine.kv_cache_manager import BlockCopy, KVCacheManager
from engine.model_runner import ModelRunner, prepare_input
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_codec import decode_model_input, encode_model_input


def h(i: int) -> bytes:
    return i.to_bytes(16, "little")


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(request_id=rid, prompt_token_ids=list(tokens),
                   sampling_params=SamplingParams(max_tokens=8))


def admit(mgr: KVCacheManager, req: Request):
    """Admits the whole uncached rest of the prompt with partial hits, as the scheduler
    does; returns the lookup."""
    computed = mgr.get_computed_blocks(req, partial_hits=True)
    assert mgr.allocate_slots(req, req.num_tokens - computed.num_computed_tokens,
                              computed) is not None
    req.num_computed_tokens = req.num_tokens
    return computed


# -- the pool's index ------------------------------------------------------------------------

def test_longest_partial_hit_finds_the_longest_sibling():
    pool = BlockPool(6, enable_caching=True, block_size=4)
    blocks = pool.get_new_blocks(6)
    tokens = {0: [5, 6, 7, 8], 1: [5, 6, 9, 9], 2: [5, 1, 1, 1], 3: [4, 6, 9, 0]}
    for i, t in tokens.items():
        pool.cache_full_block(blocks[i], h(10 + i), h(1), t)
    pool.cache_full_block(blocks[4], h(20), h(2), [5, 6, 9, 0])  # another parent
    pool.cache_full_block(blocks[5], h(21), h(1))  # tokens unknown: never a candidate
    hit = pool.longest_partial_hit(h(1), [5, 6, 9, 0])
    assert hit.block is blocks[1] and hit.num_tokens == 3
    assert pool.longest_partial_hit(h(1), [5, 1, 1]).block is blocks[2]
    assert pool.longest_partial_hit(h(1), [5, 7]).num_tokens == 1
    assert pool.longest_partial_hit(h(1), [6, 6]) is None
    assert pool.longest_partial_hit(h(3), [5, 6]) is None
    assert pool.longest_partial_hit(None, [5, 6]) is None
    # Evicted blocks leave the index; the next best sibling takes over.
    pool.free_blocks([blocks[1]])
    assert pool.get_new_blocks(1) == [blocks[1]]
    hit = pool.longest_partial_hit(h(1), [5, 6, 9, 0])
    assert hit.block is blocks[0] and hit.num_tokens == 2
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.longest_partial_hit(h(1), [5, 6]) is None
    assert pool.longest_partial_hit(h(2), [5, 6]) is None


def test_events_carry_tokens_only_when_published():
    pool = BlockPool(2, enable_caching=True, block_size=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, h(1), None, [1, 2], publish_token_ids=False)
    pool.cache_full_block(b, h(2), None, [1, 3])
    assert [e.token_ids for e in pool.take_events()] == [None, [1, 3]]
    assert pool.longest_partial_hit(None, [1, 2]).block is a  # indexed all the same


# -- the manager -----------------------------------------------------------------------------

def test_partial_hit_copies_the_cached_part_of_a_block():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(10)))
    admit(mgr, a)
    b = make_request("b", list(range(6)) + [50, 51, 52])
    # a's blocks are cached in this schedule, before the step that computes them.
    assert mgr.get_computed_blocks(b, partial_hits=True).num_computed_tokens == 4
    assert mgr.end_schedule() == []
    computed = admit(mgr, b)
    assert computed.block_ids == [0] and computed.partial_block is mgr.pool.blocks[1]
    assert computed.num_partial_tokens == 2 and computed.num_computed_tokens == 6
    assert mgr.get_block_ids("b") == [0, 3, 4]
    assert mgr.end_schedule() == [BlockCopy(1, 3)]
    assert mgr.end_schedule() == []
    assert mgr.pool.blocks[1].ref_cnt == 1  # copied, not shared
    assert mgr.stats.hits == 6 and mgr.stats.partial_hits == 2
    # Without partial hits, the same lookup stops at the whole block.
    c = make_request("c", list(range(6)) + [60])
    assert mgr.get_computed_blocks(c).num_computed_tokens == 4


def test_a_block_cached_again_in_the_open_schedule_is_no_source():
    mgr = KVCacheManager(num_blocks=3, block_size=2)
    a = make_request("a", [1, 2, 3, 4, 8, 9])
    admit(mgr, a)
    mgr.end_schedule()
    mgr.free(a)  # all three cached and free
    # r evicts blocks 2 and 1 and caches them again with its own tokens, in this schedule.
    admit(mgr, make_request("r", [1, 2, 5, 6, 7, 7]))
    assert mgr.get_block_ids("r") == [0, 2, 1]
    q = make_request("q", [1, 2, 5, 9])
    got = mgr.get_computed_blocks(q, partial_hits=True)
    assert got.partial_block is None and got.num_computed_tokens == 2
    mgr.end_schedule()  # the step computed r's blocks
    got = mgr.get_computed_blocks(q, partial_hits=True)
    assert got.partial_block is mgr.pool.blocks[2] and got.num_computed_tokens == 3


def test_partial_hit_leaves_the_last_token_to_compute():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    admit(mgr, make_request("a", list(range(12))))
    mgr.end_schedule()
    for n in (5, 6, 7, 8):  # the whole of block 1 is cached; the last token is not taken
        got = mgr.get_computed_blocks(make_request(f"b{n}", list(range(n))), partial_hits=True)
        assert got.num_computed_tokens == n - 1
    assert mgr.get_computed_blocks(make_request("c", [0]), partial_hits=True) \
        .num_computed_tokens == 0


def test_a_source_handed_back_as_the_destination_needs_no_copy():
    mgr = KVCacheManager(num_blocks=2, block_size=4)
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.end_schedule()
    mgr.free(a)  # the queue: block 1, then block 0
    b = make_request("b", [0, 1, 2, 3, 4, 5, 99])
    computed = admit(mgr, b)
    assert computed.partial_block is mgr.pool.blocks[1] and computed.num_computed_tokens == 6
    # Block 1 was the only free block: evicted and handed to b, its K/V still in place.
    assert mgr.get_block_ids("b") == [0, 1] and mgr.end_schedule() == []
    assert mgr.pool.blocks[1].block_hash is None


def test_a_partial_hit_source_moves_to_the_queue_tail():
    mgr = KVCacheManager(num_blocks=8, block_size=4)
    a = make_request("a", list(range(12)))
    admit(mgr, a)
    d = make_request("d", [70, 71, 72, 73, 74])
    admit(mgr, d)
    mgr.end_schedule()
    mgr.free(a)
    mgr.free(d)
    assert [b.block_id for b in mgr.pool.free_queue] == [5, 6, 7, 2, 1, 0, 4, 3]
    admit(mgr, make_request("b", list(range(10)) + [99]))
    assert mgr.end_schedule() == [BlockCopy(2, 5)]
    assert [b.block_id for b in mgr.pool.free_queue] == [6, 7, 4, 3, 2]


def test_a_partial_hit_evicted_before_allocation_is_refused():
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.end_schedule()
    mgr.free(a)
    b = make_request("b", [0, 1, 2, 3, 4, 99])
    computed = mgr.get_computed_blocks(b, partial_hits=True)
    mgr.pool.get_new_blocks(3)  # evicts every cached block
    with pytest.raises(RuntimeError, match="evicted"):
        mgr.allocate_slots(b, 1, computed)


def test_a_lookup_of_only_a_partial_hit_is_checked_too():
    """With no full block in the lookup, its partial source evicted and handed to another
    request was copied in as this prompt's KV."""
    mgr = KVCacheManager(num_blocks=3, block_size=4)
    a = make_request("a", list(range(8)))
    admit(mgr, a)
    mgr.end_schedule()
    mgr.free(a)
    d = make_request("d", [0, 1, 98, 97, 96])
    computed = mgr.get_computed_blocks(d, partial_hits=True)
    assert not computed.blocks and computed.partial_block is not None
    mgr.pool.get_new_blocks(3)  # evicts every cached block
    with pytest.raises(RuntimeError, match="evicted"):
        mgr.allocate_slots(d, d.num_tokens - computed.num_computed_tokens, computed)


# -- the copy and its trip to the other TP ranks ---------------------------------------------

def test_copy_blocks_gathers_sources_before_writing():
    cache = torch.arange(5 * 2 * 2 * 4 * 1 * 3, dtype=torch.float32).view(5, 2, 2, 4, 1, 3)
    runner = types.SimpleNamespace(kv_cache=cache.clone())
    ModelRunner.copy_blocks(runner, torch.tensor([[1, 2], [2, 3]]))
    want = cache.clone()
    want[2], want[3] = cache[1], cache[2]  # block 3 gets block 2's old contents
    torch.testing.assert_close(runner.kv_cache, want, rtol=0, atol=0)
    for bad in (torch.tensor([1, 2]), torch.tensor([[0, 5]]), torch.tensor([[-1, 0]])):
        with pytest.raises(ValueError):
            ModelRunner.copy_blocks(runner, bad)


def test_block_copies_survive_the_step_message():
    a = make_request("a", list(range(5, 25)))
    a.num_computed_tokens = 6
    sched = SchedulerOutput([ScheduledRequest(a, 14, [3, 4])],
                            block_copies=[BlockCopy(9, 4), BlockCopy(2, 7)])
    inp = prepare_input(sched, 16, torch.device("cpu"))
    assert inp.block_copies.tolist() == [[9, 4], [2, 7]]
    got = decode_model_input(encode_model_input(inp), torch.device("cpu"))
    assert got.block_copies.tolist() == [[9, 4], [2, 7]]
    torch.testing.assert_close(got.input_ids, inp.input_ids, rtol=0, atol=0)
    sched.block_copies = []
    plain = decode_model_input(encode_model_input(prepare_input(sched, 16, torch.device("cpu"))),
                               torch.device("cpu"))
    assert plain.block_copies is None
