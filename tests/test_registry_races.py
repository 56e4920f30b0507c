"""The registry and a worker's presence when writers race, against a real redis-server: each
race is made to happen at its exact point (a hook in the Redis client, a held heartbeat),
not hoped for by repetition."""
from __future__ import annotations

import asyncio
import logging
import time

import pytest

from engine.block_pool import BlockRemoved, BlockStored
from router.presence import WorkerPresence
from router import registry as registry_mod
from router.registry import Registry
from tests.serving_helpers import heartbeat_info

W = "prefill-0"


def _h(i: int) -> bytes:
    return i.to_bytes(8, "big")


async def _naming(reg: Registry, wid: str) -> set[str]:
    """The block hexes whose index key names ``wid``."""
    prefix = f"{reg.ns}:block:"
    return {k.decode()[len(prefix):] async for k in reg.r.scan_iter(f"{prefix}*")
            if await reg.r.sismember(k, wid)}


async def _wblocks(reg: Registry, wid: str) -> set[str]:
    return {m.decode() for m in await reg.r.smembers(f"{reg.ns}:wblocks:{wid}")}


async def _until(pred, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not await pred():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def _eventually(read, want, within_s: float = 5.0) -> None:
    """Until ``await read()`` is ``want``; else fails showing the last value."""
    deadline = time.monotonic() + within_s
    while (got := await read()) != want and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    assert got == want


async def _make_stale(reg: Registry, wid: str) -> None:
    """A router's purge of a worker whose heartbeat came late: its beat an hour old, then a
    router's read."""
    await reg.r.zadd(f"{reg.ns}:heartbeats", {wid: 0})
    await reg.live_workers()
    assert not await reg.r.hexists(f"{reg.ns}:workers", wid)


# --- unreadable entries -----------------------------------------------------------------------
def test_an_unreadable_entry_is_dropped_once_and_never_blinds_a_reader(redis_url, caplog):
    async def body():
        reg = Registry.from_url(redis_url, "bad")
        await reg.heartbeat(heartbeat_info("good"))
        await reg.r.hset("bad:workers", mapping={
            "garbage": b"\xff\xff\xff",  # not protobuf
            # not the id its field names
            "liar": heartbeat_info("someone-else").SerializeToString(),
        })
        await reg.r.zadd("bad:heartbeats", {b"\xff\xfe": 1.0})  # no id (not UTF-8), stale
        await reg.r.sadd("bad:drained", b"\xff\xfd")
        with caplog.at_level(logging.WARNING, logger="router.registry"):
            assert [i.worker_id for i in await reg.live_workers()] == ["good"]
            assert [i.worker_id for i in await reg.live_workers("prefill")] == ["good"]
        assert set(await reg.r.hkeys("bad:workers")) == {b"good"}
        assert await reg.r.zrange("bad:heartbeats", 0, -1) == [b"good"]
        # Logged once each, when dropped.
        dropped = [r for r in caplog.records if "dropped registry" in r.getMessage()]
        assert len(dropped) == 3
        await reg.r.aclose()

    asyncio.run(body())


# --- the prefix index: forget and republish -----------------------------------------------------
class _AfterCommand:
    """Runs ``inject`` once, right after the ``n``-th command ``reg`` sends on its own (not in
    a pipeline): a KV event landing at exactly that point of a multi-step write."""

    def __init__(self, reg: Registry, n: int, inject) -> None:
        self.n, self.inject, self.sent = n, inject, 0
        self._reg = reg

    def __enter__(self):
        self._reg.r.execute_command = self._execute  # commands and scripts call the instance's
        return self

    def __exit__(self, *exc) -> None:
        del self._reg.r.execute_command

    async def _send(self, *args, **kwargs):
        return await type(self._reg.r).execute_command(self._reg.r, *args, **kwargs)

    async def _execute(self, *args, **kwargs):
        out = await self._send(*args, **kwargs)
        self.sent += 1
        if self.sent == self.n + 1:
            await self.inject()
        return out


@pytest.mark.parametrize("after", range(3))
def test_a_kv_event_landing_inside_a_purge_leaves_no_orphaned_block(redis_url, after):
    """A worker's last KV event (its pipeline was on the wire when it died) lands while a
    router purges it: wherever it lands, the index keeps nothing naming the worker that a
    restart under the same id does not clear."""
    async def body():
        ns = f"orphan{after}"
        router, worker = Registry.from_url(redis_url, ns), Registry.from_url(redis_url, ns)
        await worker.heartbeat(heartbeat_info(W))
        await worker.publish_events(W, [BlockStored([_h(1), _h(2)], None, None, 16)])

        async def last_event():
            await worker.publish_events(W, [BlockStored([_h(3)], None, None, 16)])

        with _AfterCommand(router, after, last_event) as hook:
            await router.deregister(W)
        if hook.sent <= after:  # the purge took fewer steps: the event lands after it
            await last_event()
        # The index says what wblocks says: whatever is left, a forget finds.
        assert await _naming(router, W) == await _wblocks(router, W)
        await worker.clear_worker(W)  # the restarted worker's first step
        assert await _naming(router, W) == set()
        for reg in (router, worker):
            await reg.r.aclose()

    asyncio.run(body())


def test_events_flushed_during_a_republish_are_applied_after_it(redis_url):
    """A republish snapshots the cache, then replaces the index with it; the engine evicts a
    block and stores another meanwhile. Those events must land after the replace: before it,
    the evicted block would be listed again, for good, and the new one lost."""
    async def body():
        cache = [_h(1), _h(2)]
        republished = asyncio.Event()
        router = Registry.from_url(redis_url, "repub")

        async def republish(registry: Registry) -> None:  # engine/worker_runtime.py's
            snapshot = list(cache)
            cache.remove(_h(1))
            cache.append(_h(3))
            presence.add_events([BlockRemoved([_h(1)]), BlockStored([_h(3)], None, None, 16)])
            # Time for the flush to publish them, if it may (it may not: it waits).
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline and _h(1).hex() in await _wblocks(router, W):
                await asyncio.sleep(0.02)
            await registry.set_worker_blocks(W, snapshot)
            republished.set()

        presence = WorkerPresence(redis_url, "repub", 0.05, lambda: heartbeat_info(W), republish)
        await presence.start()
        try:
            presence.add_events([BlockStored(list(cache), None, None, 16)])
            await _eventually(lambda: _wblocks(router, W), {_h(1).hex(), _h(2).hex()})
            await router.deregister(W)  # its next beat finds it dropped, and republishes
            await asyncio.wait_for(republished.wait(), 10)
            want = {h.hex() for h in cache}
            await _eventually(lambda: _wblocks(router, W), want)
            assert await _naming(router, W) == want
        finally:
            await presence.stop()
            await router.r.aclose()

    asyncio.run(body())


def test_a_failed_flush_has_the_next_beat_republish(redis_url):
    """KV events that never reached Redis leave the index wrong until the worker puts its
    whole cache back: the next heartbeat does it."""
    async def body():
        republished = asyncio.Event()

        async def republish(registry: Registry) -> None:
            await registry.set_worker_blocks(W, [_h(7)])
            republished.set()

        presence = WorkerPresence(redis_url, "lostev", 0.05, lambda: heartbeat_info(W), republish)
        await presence.start()
        publish = presence.registry.publish_events

        async def fails_once(*args, **kwargs):
            presence.registry.publish_events = publish
            raise ConnectionError("Redis went away for a moment")

        presence.registry.publish_events = fails_once
        try:
            presence.add_events([BlockStored([_h(7)], None, None, 16)])
            await asyncio.wait_for(republished.wait(), 10)
            assert await _wblocks(presence.registry, W) == {_h(7).hex()}
        finally:
            await presence.stop()

    asyncio.run(body())


def test_a_worker_purged_while_alive_lists_no_block_until_it_registers_again(redis_url):
    """A live worker purged as stale (its beats held up past the TTL) flushes KV events: the
    blocks they store must not be listed under an id no heartbeat names, for were it to die
    before its next beat, no purge would ever find them. Removals and ledger events apply;
    its next beat registers it again and republishes the blocks."""
    async def body():
        republished = asyncio.Event()

        async def republish(registry: Registry) -> None:
            await registry.set_worker_blocks(W, [_h(1), _h(2)])
            republished.set()

        presence = WorkerPresence(redis_url, "purgedlive", 0.05, lambda: heartbeat_info(W),
                                  republish)
        await presence.start()
        router = Registry.from_url(redis_url, "purgedlive")
        try:
            presence.add_events([BlockStored([_h(1)], None, None, 16)])
            await _eventually(lambda: _wblocks(router, W), {_h(1).hex()})
            presence._beat_task.cancel()  # its loop held up: no beat
            await _make_stale(router, W)
            presence.add_events([BlockRemoved([_h(9)]), BlockStored([_h(2)], None, None, 16)])
            await _until(lambda: _true(presence._events_lost))
            assert await _naming(router, W) == await _wblocks(router, W) == set()
            assert not await router.publish_events(W, [BlockStored([_h(3)], None, None, 16)])
            assert await router.r.keys("purgedlive:*block*") == []
            presence._beat_task = asyncio.create_task(presence._beat())
            await asyncio.wait_for(republished.wait(), 10)
            assert await _naming(router, W) == {_h(1).hex(), _h(2).hex()}
        finally:
            await presence.stop()
            await router.r.aclose()

    asyncio.run(body())


def test_blocks_stored_while_a_purge_forgets_them_are_refused(redis_url):
    """A stale worker's purge forgets its blocks step by step (seconds for a big cache), then
    drops its entries: blocks a live worker stored in between were taken, still registered,
    and then named an id no purge would find again."""
    async def body():
        reg = Registry.from_url(redis_url, "purgewindow")
        try:
            await reg.heartbeat(heartbeat_info(W))
            await reg.set_worker_blocks(W, [_h(1)])
            await reg.r.zadd(reg._k("heartbeats"), {W: 0})  # stale
            forget, stored = reg._forget_blocks, []

            async def forget_then_store(wid: str) -> None:
                await forget(wid)
                stored.append(await reg.publish_events(
                    W, [BlockStored([_h(2)], None, None, 16)]))

            reg._forget_blocks = forget_then_store
            await reg.purge_stale()
            assert stored == [False]  # refused: the worker republishes at its next beat
            assert await reg.r.keys("purgewindow:*block*") == []
        finally:
            await reg.r.aclose()

    asyncio.run(body())


async def _true(value: bool) -> bool:
    return value


# --- drain --------------------------------------------------------------------------------------
class _HeldBeats:
    """Holds a presence's heartbeats at will: while held, the next one waits before it is
    sent, so admin and router writes land between two beats, deterministically."""

    def __init__(self, presence: WorkerPresence) -> None:
        self.done = 0
        self._open = asyncio.Event()
        self._open.set()
        self._waiting = asyncio.Event()
        self._beat = presence.registry.heartbeat
        presence.registry.heartbeat = self._held_beat

    async def _held_beat(self, *args, **kwargs):
        if not self._open.is_set():
            self._waiting.set()
            await self._open.wait()
        beat = await self._beat(*args, **kwargs)
        self.done += 1
        return beat

    async def hold(self) -> None:
        self._open.clear()
        self._waiting.clear()
        await asyncio.wait_for(self._waiting.wait(), 10)  # a beat now waits

    async def release(self, beats: int = 2) -> None:
        """Lets beats go, and waits for ``beats`` of them (the first may find the worker
        dropped; the one after shows what the worker made of it)."""
        want = self.done + beats
        self._open.set()

        async def done() -> bool:
            return self.done >= want

        await _until(done)


async def _draining(router: Registry) -> list[bool]:
    return [i.draining for i in await router.live_workers()]


async def _with_presence(redis_url: str, ns: str, scenario) -> None:
    presence = WorkerPresence(redis_url, ns, 0.05, lambda: heartbeat_info(W))
    await presence.start()
    beats = _HeldBeats(presence)
    router = Registry.from_url(redis_url, ns)
    try:
        await beats.release(1)
        await scenario(presence, beats, router)
    finally:
        await presence.stop()
        await router.r.aclose()


def test_a_drain_made_just_before_a_purge_outlives_it(redis_url):
    async def scenario(presence, beats, router):
        await beats.hold()
        assert await router.set_drained(W, True)  # the worker has not seen it ...
        await _make_stale(router, W)  # ... and a router purges it before it could
        await beats.release()
        assert await _draining(router) == [True]

    asyncio.run(_with_presence(redis_url, "drain-purge", scenario))


def test_an_undrain_made_just_before_a_purge_is_not_reversed(redis_url):
    async def scenario(presence, beats, router):
        assert await router.set_drained(W, True)
        await beats.release()  # the worker saw itself drained
        await beats.hold()
        assert await router.set_drained(W, False)
        await _make_stale(router, W)
        await beats.release()
        assert await _draining(router) == [False]
        # Purged first, undrained before it returns: the undrain holds too.
        assert await router.set_drained(W, True)
        await beats.release()
        await beats.hold()
        await _make_stale(router, W)
        assert await router.set_drained(W, False)
        await beats.release()
        assert await _draining(router) == [False]

    asyncio.run(_with_presence(redis_url, "undrain-purge", scenario))


def test_a_redis_that_forgot_gets_the_drain_the_worker_last_saw(redis_url):
    """A new empty Redis (a restart without persistence) knows no drain: the worker puts back
    the one its last beat saw."""
    async def forget_all(router: Registry) -> None:
        async for k in router.r.scan_iter(f"{router.ns}:*"):
            await router.r.delete(k)

    async def scenario(presence, beats, router):
        assert await router.set_drained(W, True)
        await beats.release()
        await beats.hold()
        await forget_all(router)
        await beats.release()
        assert await _draining(router) == [True]
        assert await router.set_drained(W, False)
        await beats.release()
        await beats.hold()
        await forget_all(router)
        await beats.release()
        assert await _draining(router) == [False]

    asyncio.run(_with_presence(redis_url, "drain-restart", scenario))


@pytest.mark.parametrize("purged_first", [False, True])
def test_a_worker_restarted_under_a_drained_id_does_not_start_drained(redis_url, purged_first):
    """Its predecessor crashed while drained (no deregister); whether a router purged the old
    entry before the new worker started must not decide whether it starts drained."""
    async def body():
        ns = f"inherit{int(purged_first)}"
        router = Registry.from_url(redis_url, ns)
        await router.heartbeat(heartbeat_info(W))  # the predecessor, then its crash
        assert await router.set_drained(W, True)
        if purged_first:
            await _make_stale(router, W)
        presence = WorkerPresence(redis_url, ns, 0.05, lambda: heartbeat_info(W))
        await presence.start()
        try:
            assert await _draining(router) == [False]
            await asyncio.sleep(0.2)  # and its beats keep it so
            assert await _draining(router) == [False]
        finally:
            await presence.stop()
            await router.r.aclose()

    asyncio.run(body())


@pytest.mark.parametrize("routers", [1, 2, 3])
def test_purges_of_its_predecessor_by_routers_ending_inside_a_restart_leave_it_whole(
        redis_url, routers):
    """A prefill worker restarts under its id while routers purge its crashed predecessor's
    stale entry (seconds, for a big cache). A purge's last step landing after the new worker
    wrote its KV handles and before its beat drops the handles; that beat registers the worker
    all the same, and its later beats find nothing dropped. Every router that found the
    predecessor stale purges it: a second router's purge can end inside the second
    registration round, a third one's as the worker writes its entries once more. The worker
    must end up with its handles: decode workers refuse the KV of a prefill worker that has
    none, for every request the routers send it."""
    async def body():
        ns = f"restart-in-{routers}-purges"
        router = Registry.from_url(redis_url, ns)
        await router.heartbeat(heartbeat_info(W))  # the predecessor, then its crash
        await router.r.zadd(router._k("heartbeats"), {W: 0})  # its beat went stale
        # The first router's purge ends in the first round; the others found the predecessor
        # stale before that round's beat, and end later.
        purges = [router.purge_stale] + [
            lambda: router._purge([W], stale_by=router.ttl_s)] * (routers - 1)

        async def prepare(reg: Registry) -> None:
            await reg.set_kv_handles(W, [b"rank-0"], b"mac-key")
            if purges:
                await purges.pop(0)()

        presence = WorkerPresence(redis_url, ns, 0.05, lambda: heartbeat_info(W), prepare)
        await presence.start(prepare)
        try:
            assert purges == []
            await asyncio.sleep(0.3)  # a registration a purge dropped: the next beat's
            assert await router.kv_source(W) == ([b"rank-0"], b"mac-key")
            assert [i.worker_id for i in await router.live_workers()] == [W]
        finally:
            await presence.stop()
            await router.r.aclose()

    asyncio.run(body())


@pytest.mark.parametrize("dies", [True, False])
@pytest.mark.parametrize("after", range(8))
def test_a_worker_beating_again_inside_its_purge_is_found_by_the_next_one(
        redis_url, monkeypatch, after, dies):
    """A router purges a worker whose beats came late; its next beat lands between two steps
    of the purge (which re-registers it) and it republishes. Whichever step that was, what
    the purge leaves is still found: a worker that dies now is purged again, blocks and all,
    and one that lives has its whole cache listed again after its next beat."""
    monkeypatch.setattr(registry_mod, "_BLOCKS_PER_STEP", 1)  # each block forgotten apart
    cache = [_h(1), _h(2), _h(3)]

    async def body():
        ns = f"beatinpurge{after}{int(dies)}"
        router, worker = Registry.from_url(redis_url, ns), Registry.from_url(redis_url, ns)

        async def beat() -> None:  # the worker's presence: a beat, and its republish
            if (await worker.heartbeat(heartbeat_info(W))).dropped:
                await worker.set_worker_blocks(W, cache)

        try:
            await worker.heartbeat(heartbeat_info("warm-up"))
            await router.r.zadd(router._k("heartbeats"), {"warm-up": 0})
            await router.purge_stale()  # loads the scripts: no NOSCRIPT round trip below
            await beat()  # registers, and lists its cache
            await router.r.zadd(router._k("heartbeats"), {W: 0})  # its beats came late
            # Its steps: the stale read, unregister, 3 + 1 block forgets (more if the
            # republish came first), the ledger's read, the last step.
            with _AfterCommand(router, after, beat) as hook:
                await router.purge_stale()
            assert hook.sent > after  # the beat landed
            assert await _naming(router, W) == await _wblocks(router, W)
            if dies:
                # Its heartbeat comes no more: one a purge still knows of goes stale.
                await router.r.zadd(router._k("heartbeats"), {W: 0}, xx=True)
                await router.purge_stale()
                assert await router.r.keys(f"{ns}:*block*") == []
            else:
                await beat()
                assert [i.worker_id for i in await router.live_workers()] == [W]
                assert await _naming(router, W) == {h.hex() for h in cache}
        finally:
            for reg in (router, worker):
                await reg.r.aclose()

    asyncio.run(body())
