"""Per-request KV block tables on top of the block pool, with prefix caching.

The scheduler asks three things of it: how much of a new request is already cached
(``get_computed_blocks``), to reserve blocks for the tokens it schedules (``allocate_slots``),
and to release a finished or preempted request (``free``). It never changes
``request.num_computed_tokens``; the scheduler does after each step.

Partial-block hits: after the last whole cached block of a prompt, a cached block that agrees
with the prompt's next tokens for only part of its length (the same shared prefix, then
another request's own tokens) still holds the right K/V for those positions, since attention
is causal. Such a hit is not shared: the request gets a new block and the step copies the
cached block into it before the forward (``end_schedule``), which then overwrites the
positions past the hit. Blocks are cached when allocated, before the step that computes them;
a copy, unlike a shared block, reads its source before that forward, so blocks cached in the
schedule being built are never partial-hit sources. Multi-turn chat is the common case: the
last turn's partial block is this turn's prefix, and a prefix of any length loses no tokens to
block alignment.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from engine.block_hash import BlockHash, hash_request_tokens
from engine.block_pool import BlockPool, KVBlock, KVCacheEvent
from engine.outputs import PrefixCacheReset
from engine.request import Request


class NoFreeBlocksError(RuntimeError):
    """The KV cache cannot hold the request right now (retry later or elsewhere)."""


@dataclass
class ComputedBlocks:
    """Leading blocks of a request found in the prefix cache (not yet held by it)."""

    blocks: list[KVBlock] = field(default_factory=list)
    num_computed_tokens: int = 0
    # A cached block whose first num_partial_tokens tokens come next in the request (copied,
    # not shared); counted in num_computed_tokens.
    partial_block: KVBlock | None = None
    num_partial_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]


@dataclass(frozen=True)
class BlockCopy:
    """Copy a whole KV block (every layer, K and V) before the step's forward."""

    src_block_id: int
    dst_block_id: int


@dataclass
class PrefixCacheStats:
    """Cumulative counters; ``queries`` and ``hits`` are in tokens."""

    requests: int = 0
    queries: int = 0
    hits: int = 0  # partial-block hits included
    evictions: int = 0
    partial_hits: int = 0  # tokens reused from partial-block hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 event_token_ids: bool = False) -> None:
        """``event_token_ids`` puts each stored block's tokens in its BlockStored event; off by
        default because subscribers can rebuild the chain from the hashes alone."""
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.event_token_ids = event_token_ids
        self.pool = BlockPool(num_blocks, enable_prefix_caching, block_size)
        self._req_blocks: dict[str, list[KVBlock]] = {}
        # The same tables as block ids in C ints, grown alongside: a step's input copies them
        # as memory (engine/model_runner.py) instead of converting a list of ints per step.
        self._req_tables: dict[str, array] = {}
        # Hashes of each request's full blocks, extended as the request grows.
        self._req_hashes: dict[str, list[BlockHash]] = {}
        # How many of a request's leading blocks have been offered to the cache.
        self._num_cached_blocks: dict[str, int] = {}
        self._block_copies: list[BlockCopy] = []
        # Blocks cached since the last end_schedule, whose K/V the coming step computes.
        self._cached_this_schedule: set[int] = set()
        self._cached_last_schedule: list[int] = []
        self._stats = PrefixCacheStats()

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    @property
    def stats(self) -> PrefixCacheStats:
        self._stats.evictions = self.pool.num_evictions
        return self._stats

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self._req_blocks.get(request_id, ())]

    def block_table(self, request_id: str) -> array:
        """The request's block ids as ``array("i")``: the live table, which later allocations
        grow, so read it now and never write it."""
        table = self._req_tables.get(request_id)
        return table if table is not None else array("i")

    def take_events(self) -> list[KVCacheEvent]:
        return self.pool.take_events()

    def end_schedule(self) -> list[BlockCopy]:
        """Closes a schedule: the copies its partial-block hits need, oldest first.

        They must run before the step's forward writes any KV (a source left in the free queue
        may have been handed out again by a later allocation). Blocks cached during the
        schedule become partial-hit sources from the next one on: its step computes them.
        """
        copies, self._block_copies = self._block_copies, []
        # Kept until the next schedule: the step that computes them may fail.
        self._cached_last_schedule = list(self._cached_this_schedule)
        self._cached_this_schedule.clear()
        return copies

    def uncache_last_schedule(self) -> None:
        """The step of the last schedule failed: the blocks it cached hold no KV of theirs,
        and a prompt sharing their prefix would read whatever they hold. Forgotten."""
        for block_id in self._cached_last_schedule:
            self.pool.uncache(self.pool.blocks[block_id])
        self._cached_last_schedule = []

    def cached_block_hashes(self) -> list[BlockHash]:
        """Every block hash in the prefix cache now (to rebuild an index that lost events)."""
        return list(self.pool.cached_blocks)

    def reset_prefix_cache(self) -> PrefixCacheReset:
        cached = self.pool.num_cached_blocks
        in_use = self.pool.num_blocks - self.pool.num_free_blocks
        done = self.pool.reset_prefix_cache()
        return PrefixCacheReset(done, cached if done else 0, in_use)

    # -- prefix cache lookup -------------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full-block hashes, hashing only blocks filled since the last call."""
        hashes = self._req_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        if len(hashes) < num_full:
            start = len(hashes) * self.block_size
            new_tokens = request.token_ids_between(start, num_full * self.block_size)
            hashes.extend(hash_request_tokens(new_tokens, self.block_size,
                                              parent=hashes[-1] if hashes else None))
        return hashes

    def get_computed_blocks(self, request: Request, partial_hits: bool = False) -> ComputedBlocks:
        """Longest cached prefix of a request that has computed nothing yet.

        Stops one token short of the whole request: the last token must run through the model
        for its logits. With ``partial_hits`` it goes on into the cached block that shares the
        most of the next block's tokens (the caller's step must then run the copies from
        ``end_schedule``). Use the result right away: the blocks are not held, so any
        allocation in between may evict them.
        """
        if request.num_computed_tokens != 0:
            raise ValueError(f"request {request.request_id} already has "
                             f"{request.num_computed_tokens} computed tokens")
        if not self.enable_prefix_caching:
            return ComputedBlocks()
        hashes = self._block_hashes(request)
        max_hit_blocks = max(0, request.num_tokens - 1) // self.block_size
        blocks = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        computed = ComputedBlocks(blocks, len(blocks) * self.block_size)
        if partial_hits:
            self._add_partial_hit(request, computed, hashes)
        return computed

    def _add_partial_hit(self, request: Request, computed: ComputedBlocks,
                         hashes: list[BlockHash]) -> None:
        start = computed.num_computed_tokens
        # Past the last whole hit, at most up to the request's last token (never its own).
        end = min(start + self.block_size, request.num_tokens - 1)
        if end <= start:
            return
        parent = hashes[len(computed.blocks) - 1] if computed.blocks else None
        hit = self.pool.longest_partial_hit(parent, request.token_ids_between(start, end))
        if hit is None or hit.block.block_id in self._cached_this_schedule:
            return
        # A whole block's match would have been a hash hit; never claim one here.
        n = min(hit.num_tokens, self.block_size - 1)
        computed.partial_block = hit.block
        computed.num_partial_tokens = n
        computed.num_computed_tokens += n

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: ComputedBlocks | None = None,
                       cache_blocks: bool = True) -> list[int] | None:
        """Grows the request's block table to cover its computed plus ``num_new_tokens`` tokens.

        Returns the ids of the newly allocated blocks, or None, changing nothing, when the pool
        is short. ``computed`` (from ``get_computed_blocks``) becomes the head of the table.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        looked_up = computed is not None and self.enable_prefix_caching
        computed = computed or ComputedBlocks()
        held = self._req_blocks.get(request.request_id, [])
        if computed.blocks or computed.partial_block is not None:
            self._check_computed(request, computed, held)
        num_total = request.num_computed_tokens + computed.num_computed_tokens + num_new_tokens
        num_new_blocks = max(0, _cdiv(num_total, self.block_size)
                             - len(held) - len(computed.blocks))
        # Cached blocks nobody holds are counted as free, yet touching them takes them out of
        # the free queue, so they cannot also serve as new blocks.
        num_reclaimed = sum(1 for b in computed.blocks if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_reclaimed:
            return None

        # Touch first: get_new_blocks would otherwise evict a reclaimed block from the queue.
        self.pool.touch(computed.blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        if computed.partial_block is not None:
            self._copy_partial_hit(computed.partial_block, new_blocks[0])
        if request.request_id not in self._req_blocks:
            self._req_blocks[request.request_id] = held
            self._req_tables[request.request_id] = array("i")
            self._num_cached_blocks[request.request_id] = len(computed.blocks)
        held.extend(computed.blocks)
        held.extend(new_blocks)
        self._req_tables[request.request_id].extend(
            [b.block_id for b in computed.blocks] + [b.block_id for b in new_blocks])
        if looked_up and request.num_cached_tokens < 0:
            # Counted on its first admission only (the scheduler sets num_cached_tokens then):
            # a request retried while the pool is short counts once, and one preempted or
            # started over after a failed step does not count its own blocks as hits again.
            self._stats.requests += 1
            self._stats.queries += request.num_tokens
            self._stats.hits += computed.num_computed_tokens
            self._stats.partial_hits += computed.num_partial_tokens
        if cache_blocks:
            self._cache_full_blocks(request, min(num_total, request.num_tokens))
        return [b.block_id for b in new_blocks]

    def _copy_partial_hit(self, src: KVBlock, dst: KVBlock) -> None:
        # The allocation may have evicted src and handed it to this very request as dst: its
        # K/V is still there, nothing to copy.
        if src is not dst:
            self._block_copies.append(BlockCopy(src.block_id, dst.block_id))
        if src.ref_cnt == 0 and src.block_hash is not None:
            # Used just now: to the queue's tail, the last to be evicted.
            self.pool.touch([src])
            self.pool.free_blocks([src])

    def _check_computed(self, request: Request, computed: ComputedBlocks,
                        held: list[KVBlock]) -> None:
        if held or request.num_computed_tokens != 0:
            raise ValueError(f"computed blocks given for request {request.request_id}, "
                             "which has already started")
        full = len(computed.blocks) * self.block_size
        if computed.num_computed_tokens != full + computed.num_partial_tokens:
            raise ValueError(f"computed.num_computed_tokens {computed.num_computed_tokens} does "
                             f"not match {len(computed.blocks)} blocks of {self.block_size} and "
                             f"{computed.num_partial_tokens} tokens of a partial hit")
        if computed.partial_block is not None:
            self._check_partial_hit(request, computed, full)
        hashes = self._block_hashes(request)
        for i, block in enumerate(computed.blocks):
            if i >= len(hashes) or block.block_hash != hashes[i]:
                raise RuntimeError(f"computed block {block.block_id} of request "
                                   f"{request.request_id} was evicted or does not match its "
                                   "tokens; call allocate_slots right after get_computed_blocks")

    def _check_partial_hit(self, request: Request, computed: ComputedBlocks, full: int) -> None:
        src, n = computed.partial_block, computed.num_partial_tokens
        if not 0 < n < self.block_size or full + n >= request.num_tokens:
            raise ValueError(f"a partial hit of {n} tokens after {full} does not fit request "
                             f"{request.request_id} of {request.num_tokens} tokens")
        if (src.block_hash is None or src.token_ids is None
                or list(src.token_ids[:n]) != request.token_ids_between(full, full + n)):
            raise RuntimeError(f"partial-hit block {src.block_id} of request "
                               f"{request.request_id} was evicted or does not match its tokens; "
                               "call allocate_slots right after get_computed_blocks")

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Registers the request's full blocks covering its first ``num_tokens`` tokens.

        For K/V written from outside (the decode role), once it has landed.
        """
        held = self._req_blocks.get(request.request_id, [])
        if num_tokens > request.num_tokens:
            raise ValueError(f"cannot cache {num_tokens} tokens of request "
                             f"{request.request_id}, which has {request.num_tokens}")
        if num_tokens // self.block_size > len(held):
            raise ValueError(f"request {request.request_id} holds {len(held)} blocks, too few "
                             f"for {num_tokens} tokens")
        # Written already: not the coming step's to compute, so a failure of that step does
        # not uncache them (it did, and the request never cached them again).
        self._cache_full_blocks(request, num_tokens, pending=False)

    def _cache_full_blocks(self, request: Request, num_tokens: int,
                           pending: bool = True) -> None:
        """``pending``: the blocks' KV is the coming step's to compute (uncached if it
        fails, no partial-hit source until it ran)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        start, end = self._num_cached_blocks.get(rid, 0), num_tokens // self.block_size
        if end <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self._req_blocks[rid]
        bs = self.block_size
        for i in range(start, end):
            if self.pool.cache_full_block(
                    blocks[i], hashes[i], parent_block_hash=hashes[i - 1] if i else None,
                    token_ids=request.token_ids_between(i * bs, (i + 1) * bs),
                    publish_token_ids=self.event_token_ids) and pending:
                self._cached_this_schedule.add(blocks[i].block_id)
        self._num_cached_blocks[rid] = end

    def free(self, request: Request) -> None:
        """Releases the request's blocks, tail first so its head blocks stay cached longest."""
        rid = request.request_id
        self._req_hashes.pop(rid, None)
        self._num_cached_blocks.pop(rid, None)
        blocks = self._req_blocks.pop(rid, None)
        self._req_tables.pop(rid, None)
        if blocks:
            self.pool.free_blocks(reversed(blocks))
