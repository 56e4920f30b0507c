"""Property-based test of KVCacheManager against a plain model of the pool.

Random requests over a tiny vocabulary share prefixes by construction; they are added with
prefix-cache lookup, grown by prefill chunks and decode tokens, and freed, in any order, with
allocations failing when the pool runs short. After every step the pool must agree with the
model: ref counts, the exact LRU order of the free queue, the cache map, the event stream,
the counters, and the content of every block a request reads. With partial-block hits on, a
hit's source must hold the request's next tokens, be the longest such sibling, never be a
block cached since the last schedule ended, and its copy must come out of ``end_schedule``.
"""
from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (Bundle, RuleBasedStateMachine, consumes, initialize,
                                 invariant, precondition, rule)

from engine.block_hash import hash_request_tokens
from engine.block_pool import BlockRemoved, BlockStored
from engine.kv_cache_manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams

VOCAB = st.integers(0, 3)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PrefixCacheMachine(RuleBasedStateMachine):
    live = Bundle("live")

    @initialize(block_size=st.integers(1, 4), num_blocks=st.integers(2, 14),
                bank=st.lists(st.lists(VOCAB, min_size=1, max_size=14), min_size=1, max_size=3),
                partial=st.booleans())
    def setup(self, block_size: int, num_blocks: int, bank: list[list[int]],
              partial: bool) -> None:
        self.bs = block_size
        self.partial = partial
        # Blocks cached since the last end_schedule (their step has not run), and the copies
        # that end_schedule owes.
        self.pending: set[int] = set()
        self.expected_copies: list[tuple[int, int]] = []
        self.num_blocks = num_blocks
        self.bank = bank
        self.mgr = KVCacheManager(num_blocks, block_size)
        self.requests: dict[str, Request] = {}
        self.next_id = 0
        # Model state.
        self.free_order = list(range(num_blocks))  # expected free queue, head first
        self.cached: set[bytes] = set()  # hashes per the event stream
        self.content: dict[int, tuple[int, ...]] = {}  # block id -> tokens whose K/V it holds
        self.counts = {"requests": 0, "queries": 0, "hits": 0, "evictions": 0, "partial": 0}

    # -- model helpers -------------------------------------------------------------------------

    def model_ref(self, block_id: int) -> int:
        return sum(block_id in self.mgr.get_block_ids(r) for r in self.requests)

    def snapshot(self) -> tuple:
        pool = self.mgr.pool
        return ([b.block_id for b in pool.free_queue], [b.ref_cnt for b in pool.blocks],
                [b.block_hash for b in pool.blocks], dict(pool.cached_blocks),
                pool.num_evictions, len(pool._events),
                {r: self.mgr.get_block_ids(r) for r in self.requests})

    def allocate(self, req: Request, num_new: int, computed=None) -> bool:
        """allocate_slots, checked against the model; advances the request on success."""
        mgr, bs = self.mgr, self.bs
        computed_blocks = computed.blocks if computed else []
        held = mgr.get_block_ids(req.request_id)
        num_hit = computed.num_computed_tokens if computed else 0
        total = req.num_computed_tokens + num_hit + num_new
        needed = max(0, cdiv(total, bs) - len(held) - len(computed_blocks))
        reclaimed = [b.block_id for b in computed_blocks if self.model_ref(b.block_id) == 0]
        fits = needed <= len(self.free_order) - len(reclaimed)
        before = self.snapshot()
        hashed_before = {b.block_id for b in mgr.pool.blocks if b.block_hash is not None}

        new_ids = mgr.allocate_slots(req, num_new, computed)

        if new_ids is None:
            assert not fits
            assert self.snapshot() == before, "a failed allocation changed the pool"
            return False
        assert fits
        for block_id in reclaimed:
            self.free_order.remove(block_id)
        # LRU: new blocks come off the head of the free queue, least recently freed first.
        assert new_ids == self.free_order[:needed]
        del self.free_order[:needed]
        self.counts["evictions"] += len(hashed_before & set(new_ids))
        for block_id in new_ids:
            self.content.pop(block_id, None)
        if computed is not None and computed.partial_block is not None:
            src = computed.partial_block.block_id
            if src != new_ids[0]:
                self.expected_copies.append((src, new_ids[0]))
            if src in self.free_order:  # still free and cached: used just now, to the tail
                self.free_order.remove(src)
                self.free_order.append(src)
        # Cached by this allocation: newly, or again after its eviction handed it out here.
        self.pending |= {b.block_id for b in mgr.pool.blocks if b.block_hash is not None
                         and (b.block_id not in hashed_before or b.block_id in new_ids)}
        self.requests[req.request_id] = req
        req.num_computed_tokens = total
        # Record what the request wrote into its own (non-hit) full blocks.
        table = mgr.get_block_ids(req.request_id)
        tokens = req.all_token_ids
        for i in range(len(computed_blocks), min(total, req.num_tokens) // bs):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            if table[i] in self.content and self.model_ref(table[i]) > 1:
                assert self.content[table[i]] == block_tokens
            self.content[table[i]] = block_tokens
        return True

    def check_partial_hit(self, tokens: list[int], computed, parent) -> None:
        start = len(computed.blocks) * self.bs
        want = tokens[start:min(start + self.bs, len(tokens) - 1)]
        lcp = {}  # cached sibling -> tokens it shares with what comes next
        for b in self.mgr.pool.blocks:
            if b.block_hash is not None and b.parent_hash == parent and want:
                n = 0
                while n < len(want) and b.token_ids[n] == want[n]:
                    n += 1
                lcp[b.block_id] = n
        best = max(lcp.values(), default=0)
        if computed.partial_block is None:
            assert computed.num_partial_tokens == 0
            # None: partial hits off, nothing shares a token, or a best one is not computed yet.
            assert (not self.partial or best == 0
                    or any(n == best and b in self.pending for b, n in lcp.items()))
            return
        src, n = computed.partial_block.block_id, computed.num_partial_tokens
        assert self.partial and src not in self.pending
        assert n == min(best, self.bs - 1) == min(lcp[src], self.bs - 1) > 0
        assert self.content[src][:n] == tuple(want[:n])

    # -- rules -------------------------------------------------------------------------------

    @rule(target=live, which=st.integers(0, 2), cut=st.integers(0, 14),
          suffix=st.lists(VOCAB, max_size=6), chunk=st.integers(1, 16))
    def add_request(self, which, cut, suffix, chunk):
        tokens = self.bank[which % len(self.bank)][:cut] + suffix or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        req = Request(request_id=rid, prompt_token_ids=tokens,
                      sampling_params=SamplingParams(max_tokens=8))
        computed = self.mgr.get_computed_blocks(req, partial_hits=self.partial)
        k = len(computed.blocks)
        hashes = hash_request_tokens(tokens, self.bs)
        # A hit is the longest cached run, short of the whole request, and holds its tokens.
        assert computed.num_computed_tokens == k * self.bs + computed.num_partial_tokens \
            < len(tokens)
        assert [b.block_hash for b in computed.blocks] == hashes[:k]
        if k < (len(tokens) - 1) // self.bs:
            assert hashes[k] not in self.mgr.pool.cached_blocks
        for i, block in enumerate(computed.blocks):
            assert self.content[block.block_id] == tuple(tokens[i * self.bs:(i + 1) * self.bs])
        self.check_partial_hit(tokens, computed, hashes[k - 1] if k else None)
        num_new = min(chunk, len(tokens) - computed.num_computed_tokens)
        if not self.allocate(req, num_new, computed):
            self.mgr.free(req)  # the scheduler would keep it waiting; drop it here
        else:
            # Lookups count once, when the request is admitted.
            self.counts["requests"] += 1
            self.counts["queries"] += len(tokens)
            self.counts["hits"] += computed.num_computed_tokens
            self.counts["partial"] += computed.num_partial_tokens
        return rid

    @rule(rid=live, chunk=st.integers(1, 8), token=VOCAB)
    def step(self, rid, chunk, token):
        req = self.requests.get(rid)
        if req is None:
            return
        if req.num_computed_tokens < req.num_tokens:  # prefill chunk
            self.allocate(req, min(chunk, req.num_tokens - req.num_computed_tokens))
        else:  # decode: the sampled token's K/V is computed next step
            req.append_output_token(token)
            self.allocate(req, 1)

    @rule()
    def end_schedule(self):
        copies = self.mgr.end_schedule()
        assert [(c.src_block_id, c.dst_block_id) for c in copies] == self.expected_copies
        self.expected_copies = []
        self.pending.clear()

    @rule(rid=consumes(live))
    def free_request(self, rid):
        req = self.requests.pop(rid, None)
        if req is None:
            self.mgr.free(Request(rid, [0], SamplingParams()))  # unknown request: a no-op
            return
        table = self.mgr.get_block_ids(rid)
        self.mgr.free(req)
        assert not self.mgr.block_table(rid)  # freed with the blocks
        for block_id in reversed(table):
            if self.model_ref(block_id) == 0:
                self.free_order.append(block_id)

    @precondition(lambda self: len(self.requests) > 3)
    @rule()
    def free_all(self):
        for rid in list(self.requests):
            self.free_request(rid)
        assert self.mgr.num_free_blocks == self.num_blocks
        assert all(b.ref_cnt == 0 for b in self.mgr.pool.blocks)

    @rule()
    def reset_prefix_cache(self):
        before = self.snapshot()
        cached = self.mgr.pool.num_cached_blocks
        held = self.mgr.pool.num_blocks - self.mgr.pool.num_free_blocks
        done = self.mgr.reset_prefix_cache()
        ok = done.reset
        assert ok == (not self.requests)
        assert done.num_blocks_in_use == held
        assert done.num_blocks_evicted == (cached if ok else 0)
        if ok:
            assert self.mgr.pool.num_cached_blocks == 0
        else:
            assert self.snapshot() == before

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def pool_matches_model(self):
        pool = self.mgr.pool
        assert [b.block_id for b in pool.free_queue] == self.free_order
        held = set()
        for rid in self.requests:
            table = self.mgr.get_block_ids(rid)
            assert len(table) == len(set(table)), "a block held twice by one request"
            # The C-int mirror a step's input copies (engine/model_runner.py) keeps pace.
            assert self.mgr.block_table(rid).tolist() == table
            held.update(table)
        for block in pool.blocks:
            assert block.ref_cnt == self.model_ref(block.block_id)
            assert block.in_free_queue == (block.ref_cnt == 0)
        assert self.mgr.num_free_blocks + len(held) == self.num_blocks

    @invariant()
    def cache_map_matches_blocks_and_events(self):
        pool = self.mgr.pool
        for block_hash, block in pool.cached_blocks.items():
            assert block.block_hash == block_hash
        assert sum(b.block_hash is not None for b in pool.blocks) == len(pool.cached_blocks)
        for event in self.mgr.take_events():
            if isinstance(event, BlockStored):
                assert event.block_size == self.bs
                assert not self.cached & set(event.block_hashes)
                self.cached.update(event.block_hashes)
            else:
                assert isinstance(event, BlockRemoved)
                assert set(event.block_hashes) <= self.cached
                self.cached.difference_update(event.block_hashes)
        assert self.cached == set(pool.cached_blocks)

    @invariant()
    def requests_read_their_own_tokens(self):
        for rid, req in self.requests.items():
            table = self.mgr.get_block_ids(rid)
            assert len(table) == cdiv(req.num_computed_tokens, self.bs)
            hashes = hash_request_tokens(req.all_token_ids, self.bs)
            for i in range(min(req.num_computed_tokens, req.num_tokens) // self.bs):
                block = self.mgr.pool.blocks[table[i]]
                assert self.content[block.block_id] == \
                    tuple(req.all_token_ids[i * self.bs:(i + 1) * self.bs])
                assert block.block_hash in (None, hashes[i])

    @invariant()
    def counters_add_up(self):
        stats = self.mgr.stats
        assert (stats.requests, stats.queries, stats.hits, stats.evictions,
                stats.partial_hits) == (
            self.counts["requests"], self.counts["queries"], self.counts["hits"],
            self.counts["evictions"], self.counts["partial"])

    def teardown(self):
        if not hasattr(self, "mgr"):
            return
        for rid in list(self.requests):
            self.free_request(rid)
        self.pool_matches_model()
        assert self.mgr.num_free_blocks == self.num_blocks


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCache = PrefixCacheMachine.TestCase
