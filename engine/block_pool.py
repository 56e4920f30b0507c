"""The pool of paged KV blocks: ref counts, the LRU free queue and the prefix-cache map.

Bookkeeping only; the tensors live in the model runner, indexed by ``block_id``.

A block with ``ref_cnt == 0`` sits in the free queue. If it still carries a ``block_hash`` its
K/V is intact and a later request may reclaim it (a prefix-cache hit) until the queue hands it
out again, at which point it is evicted. Blocks are freed to the tail and allocated from the
head, so the least recently freed cached block is evicted first.

A cached block whose tokens are known is also indexed under its parent's hash, siblings in
token order, so a prompt that agrees with it for only part of a block can still reuse those
leading positions (``longest_partial_hit``; the KV cache manager copies them into a block of
its own).
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Union

from engine.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is registered in the prefix cache (full, with known content).
    block_hash: BlockHash | None = None
    # While cached with known tokens: what ``longest_partial_hit`` compares against.
    parent_hash: BlockHash | None = field(default=None, repr=False)
    token_ids: tuple[int, ...] | None = field(default=None, repr=False)
    # Free-queue links; both are None exactly when the block is not in the queue.
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)

    @property
    def in_free_queue(self) -> bool:
        return self.prev_free is not None


class FreeBlockQueue:
    """Doubly linked list of blocks: O(1) popleft, append and removal from the middle.

    A ``deque`` cannot remove from the middle in O(1), and a prefix-cache hit must pull an
    arbitrary block out of the queue.
    """

    def __init__(self, blocks: Iterable[KVBlock] = ()) -> None:
        # Sentinels keep every real block's links non-None while queued.
        self._head = KVBlock(block_id=-1)
        self._tail = KVBlock(block_id=-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._len = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def append(self, block: KVBlock) -> None:
        if block.in_free_queue:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self._len += 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise RuntimeError("pop from an empty free queue")
        self.remove(first)
        return first

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self._len -= 1


@dataclass
class BlockStored:
    """Blocks entered the prefix cache; ``block_hashes`` is a chain starting under the parent."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    # The blocks' tokens, block after block; None when the publisher leaves them out.
    token_ids: list[int] | None
    block_size: int


@dataclass
class BlockRemoved:
    block_hashes: list[BlockHash]


KVCacheEvent = Union[BlockStored, BlockRemoved]


@dataclass
class PartialHit:
    """A cached block whose first ``num_tokens`` tokens are the ones asked about."""

    block: KVBlock
    num_tokens: int


class _Siblings:
    """The cached blocks under one parent, sorted by their tokens.

    In lexicographic order the entry sharing the longest prefix with a query sits right
    beside the query's insertion point, so a lookup is one bisection and two comparisons
    however many continuations a popular prefix has (a system prompt followed by ten
    thousand different questions is ten thousand siblings).
    """

    def __init__(self) -> None:
        self.keys: list[tuple[int, ...]] = []
        self.blocks: list[KVBlock] = []

    def add(self, block: KVBlock) -> None:
        i = bisect.bisect_left(self.keys, block.token_ids)
        self.keys.insert(i, block.token_ids)
        self.blocks.insert(i, block)

    def remove(self, block: KVBlock) -> None:
        i = bisect.bisect_left(self.keys, block.token_ids)
        if i == len(self.blocks) or self.blocks[i] is not block:
            raise RuntimeError(f"block {block.block_id} is missing from its parent's index")
        del self.keys[i], self.blocks[i]

    def longest(self, token_ids: tuple[int, ...]) -> PartialHit | None:
        i = bisect.bisect_left(self.keys, token_ids)
        best: PartialHit | None = None
        for j in (i - 1, i):
            if 0 <= j < len(self.keys):
                n = _common_prefix_len(self.keys[j], token_ids)
                if n and (best is None or n > best.num_tokens):
                    best = PartialHit(self.blocks[j], n)
        return best


def _common_prefix_len(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, block_size: int = 16) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Only used to label events and check their token counts.
        self.block_size = block_size
        self.blocks = [KVBlock(block_id=i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached_blocks: dict[BlockHash, KVBlock] = {}
        # Parent hash (None for first blocks) -> its cached children whose tokens are known.
        self._children: dict[BlockHash | None, _Siblings] = {}
        self.num_evictions = 0
        self._events: list[KVCacheEvent] = []
        # Off where nobody takes the events (an offline engine): they would pile up for good.
        self.record_events = True

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds, cached ones included (they are evictable)."""
        return len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_blocks)

    def get_new_blocks(self, num_blocks: int) -> list[KVBlock]:
        """Takes ``num_blocks`` blocks from the queue head, evicting cached ones, with ref 1."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"asked for {num_blocks} blocks with only "
                               f"{len(self.free_queue)} free; check num_free_blocks first")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def _evict(self, block: KVBlock) -> None:
        if self.uncache(block):
            self.num_evictions += 1

    def uncache(self, block: KVBlock) -> bool:
        """Forgets the block's hash (its KV is not what the hash says: a step that was to
        compute it failed); whether it had one."""
        if block.block_hash is None:
            return False
        del self.cached_blocks[block.block_hash]
        self._unindex(block)
        self._record(BlockRemoved([block.block_hash]))
        block.block_hash = None
        return True

    def _unindex(self, block: KVBlock) -> None:
        if block.token_ids is None:
            return
        siblings = self._children[block.parent_hash]
        siblings.remove(block)
        if not siblings.keys:
            del self._children[block.parent_hash]
        block.parent_hash = block.token_ids = None

    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        """The block holding ``block_hash``, held or not; the caller must touch it to keep it."""
        if not self.enable_caching:
            return None
        return self.cached_blocks.get(block_hash)

    def longest_partial_hit(self, parent_block_hash: BlockHash | None,
                            token_ids: Sequence[int]) -> PartialHit | None:
        """The cached block after ``parent_block_hash`` (None: a first block) that starts with
        the longest run of ``token_ids``; None when none starts with token_ids[0].

        Only blocks cached with their tokens are candidates. Like ``get_cached_block``, the
        block is not held.
        """
        siblings = self._children.get(parent_block_hash) if self.enable_caching else None
        if siblings is None or not token_ids:
            return None
        return siblings.longest(tuple(token_ids))

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Adds a reference; a block nobody held leaves the free queue so it is not evicted."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks_in_eviction_order: Iterable[KVBlock]) -> None:
        """Drops a reference; blocks reaching 0 join the queue tail in the given order."""
        for block in blocks_in_eviction_order:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id} "
                                   f"(ref_cnt {block.ref_cnt})")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVBlock, block_hash: BlockHash,
                         parent_block_hash: BlockHash | None = None,
                         token_ids: Sequence[int] | None = None,
                         publish_token_ids: bool = True) -> bool:
        """Registers a full block under ``block_hash``; returns whether it was registered.

        With ``token_ids`` (the block's tokens) the block becomes a candidate for partial hits
        under ``parent_block_hash``, and its BlockStored event carries them unless
        ``publish_token_ids`` is False.

        If another block already holds ``block_hash`` (two requests computed the same prefix
        at the same time) the first mapping is kept and this block stays uncached: it is freed
        like any partial block. Keeping the first means a hit never moves under a reader, and
        the router, which saw only the first BlockStored, stays right.
        """
        if not self.enable_caching:
            return False
        if block.ref_cnt <= 0:
            raise RuntimeError(f"caching block {block.block_id} that nobody holds")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under another hash")
            return False
        if block_hash in self.cached_blocks:
            return False
        if token_ids is not None and len(token_ids) != self.block_size:
            raise ValueError(f"a full block has {self.block_size} tokens, got {len(token_ids)}")
        block.block_hash = block_hash
        self.cached_blocks[block_hash] = block
        if token_ids is not None:
            block.parent_hash, block.token_ids = parent_block_hash, tuple(token_ids)
            self._children.setdefault(parent_block_hash, _Siblings()).add(block)
        published = list(token_ids) if token_ids is not None and publish_token_ids else None
        self._record(BlockStored([block_hash], parent_block_hash, published, self.block_size))
        return True

    def _record(self, event: KVCacheEvent) -> None:
        """Appends an event, merging it into the previous one when the stream means the same.

        A prompt of N blocks would otherwise publish N messages; consecutive removals merge,
        and a store continuing the previous store's chain extends it.
        """
        if not self.record_events:
            return
        last = self._events[-1] if self._events else None
        if isinstance(event, BlockRemoved) and isinstance(last, BlockRemoved):
            last.block_hashes.extend(event.block_hashes)
            return
        if (isinstance(event, BlockStored) and isinstance(last, BlockStored)
                and event.parent_block_hash == last.block_hashes[-1]
                and (event.token_ids is None) == (last.token_ids is None)):
            last.block_hashes.extend(event.block_hashes)
            if last.token_ids is not None and event.token_ids is not None:
                last.token_ids.extend(event.token_ids)
            return
        self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached block; refused (False) while any block is held.

        Dropping the hashes of blocks still in use would free no memory, and the requests
        holding them would go on registering children of chains the router was told are gone.
        """
        if len(self.free_queue) != self.num_blocks:
            return False
        if self.cached_blocks:
            self._record(BlockRemoved(list(self.cached_blocks)))
        for block in self.cached_blocks.values():
            block.block_hash = None
            block.parent_hash = block.token_ids = None
        self.cached_blocks.clear()
        self._children.clear()
        return True
