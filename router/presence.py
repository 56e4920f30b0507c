"""A worker's presence in the cluster: registry heartbeats and its prefix-cache events.

Runs on the worker's event loop. Events come from the engine thread (through
``loop.call_soon_threadsafe(presence.add_events, ...)``) and are flushed in order by one task.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from client.tasks import stop_task
from protos import common_pb2
from router.ledger import is_ledger_event
from router.registry import ROUTER_TTL_S, Registry

logger = logging.getLogger(__name__)

_STOP_STEP_S = 2.0


class WorkerPresence:
    def __init__(self, redis_url: str, namespace: str, interval_s: float,
                 info: Callable[[], common_pb2.WorkerInfo],
                 republish: Callable[[Registry], Awaitable[None]] | None = None,
                 on_database_missing: Callable[[str], None] | None = None) -> None:
        """``republish`` puts back what the worker keeps in Redis besides its heartbeat (its
        KV handles, its cached blocks) once Redis answers again after failing, once a purge
        dropped the worker, or once KV events failed to publish: events lost, or a new empty
        Redis, would leave the prefix index wrong for good. ``on_database_missing``: see
        Registry.from_url."""
        # Stale after a few missed beats, so a killed worker drops out within seconds.
        ttl_s = max(3 * interval_s, 1.0)
        self.registry = Registry.from_url(redis_url, namespace, ttl_s=ttl_s,
                                          on_database_missing=on_database_missing)
        # Declared with each beat, as how long readers wait for this worker: a decode worker's
        # reads (its KV peers) purge by their own TTL only workers past theirs too, so a
        # prefill worker beating slower is not dropped. At most the routers' TTL, so they
        # drop a dead worker as fast as ever.
        self.beat_ttl_s = min(ttl_s, ROUTER_TTL_S)
        self.interval_s = interval_s
        self.info = info
        self._events: list = []
        self._have_events = asyncio.Event()
        self._beat_task: asyncio.Task | None = None
        self._flush_task: asyncio.Task | None = None
        self.republish = republish
        self._lost = False  # a heartbeat failed since the last one that went through
        self._last_beat: float | None = None  # loop time the last beat went through
        # Some KV events never reached Redis (a flush failed): the next beat republishes.
        self._events_lost = False
        self._drained = False  # an admin drained it, as its last beat saw
        # Held by an event flush and by a republish: the republish replaces what the index
        # says the worker holds with a snapshot, and an event published between the snapshot
        # and that write would be undone by it (an evicted block listed again, for good).
        # Events arriving meanwhile wait in _events, and are published after it.
        self._publishing = asyncio.Lock()
        # Checked each round, so the loop stops even if a cancel is swallowed (client/tasks.py).
        self._stopping = False
        # Left routing for a drain (``leave``): no heartbeat, only ledger events published.
        self._left = False
        # Redis did not answer at start: the first beat through clears and republishes first.
        self._unregistered = False

    async def start(self, prepare: Callable[[Registry], Awaitable[None]] | None = None) -> None:
        """Registers the worker (``prepare`` first writes what must be in Redis before it is
        routable: a prefill worker's KV handles). A Redis that does not answer now does not
        stop the worker, which has loaded its model by then (a restart would load it again):
        it serves, and registers at the first beat that goes through, as a router starts on
        an empty view and fills it once Redis answers."""
        try:
            await self._register(None if prepare is None else lambda: prepare(self.registry))
        except Exception as e:  # noqa: BLE001 - Redis away: the beats retry
            logger.error("worker %s: registering in Redis failed (%s); serving, and retrying "
                         "every %.1f s: no router sends it requests until then",
                         self.info().worker_id, e, self.interval_s)
            self._unregistered = True
        self._beat_task = asyncio.create_task(self._beat())
        self._flush_task = asyncio.create_task(self._flush())

    async def _register(self, prepare: Callable[[], Awaitable[None]] | None) -> None:
        """A predecessor's entries under this id go, ``prepare`` writes what must be there
        before the worker is routable, then a first heartbeat (it finds no registration,
        which is no drop); all again if a purge of the id ended meanwhile."""
        info = self.info()
        for _ in range(2):
            await self.registry.clear_worker(info.worker_id)
            if prepare is not None:
                await prepare()
            beat = await self.registry.heartbeat(info, ttl_s=self.beat_ttl_s)
            # A router's purge of a crashed predecessor under this id (stale, its big cache
            # taking seconds) ended after the clear: its last step dropped what ``prepare``
            # wrote (the KV handles, without which decode workers refuse this worker's KV),
            # which no later beat finds dropped: this one registered the worker as a first
            # beat does. Once more: the beat is fresh now, and no purge starts that takes it
            # for stale (one under way already may still end).
            if not beat.purged:
                break
            logger.info("worker %s: a purge of its predecessor's entries ended as it "
                        "registered; its entries are written again", info.worker_id)
        else:
            # Another router's purge, begun while the predecessor was stale, ended in the
            # second round too. What it dropped is written once more, past the beat: a purge
            # ending now also drops the registration, so the next beat finds that and
            # republishes. Not round after round: one longer than the heartbeat TTL (the whole
            # republish of _beat_once's late registration) would be purged as stale in each.
            if prepare is not None:
                await prepare()
        self._last_beat = asyncio.get_running_loop().time()

    def add_events(self, events: list) -> None:
        self._events.extend(events)
        self._have_events.set()

    async def _beat(self) -> None:
        while not (self._stopping or self._left):
            await asyncio.sleep(self.interval_s)
            try:
                await self._beat_once()
            except Exception as e:  # noqa: BLE001 - Redis away: keep serving, retry next beat
                if not self._lost:
                    logger.warning("heartbeat failed: %s", e)
                self._lost = True

    async def _beat_once(self) -> None:
        if self._unregistered:  # as start() would have, with everything the worker holds
            await self._register(lambda: self._republish_now(
                False, "Redis answered after the worker's start"))
            self._unregistered = self._lost = False
            return
        # The drain as this worker last saw it: Redis puts it back if it forgot it (a
        # restart), and gives back an admin's later decision if a purge kept it.
        beat = await self.registry.heartbeat(self.info(), ttl_s=self.beat_ttl_s,
                                             drained=self._drained)
        now = asyncio.get_running_loop().time()
        gap, self._last_beat = now - (self._last_beat or now), now
        self._drained = beat.drained
        if beat.dropped and not self._lost:
            self._log_drop(gap)
        if self._lost or beat.dropped or self._events_lost:
            await self._republish_now(beat.dropped)
        self._lost = False

    def _log_drop(self, gap_s: float) -> None:
        """Why the registry had dropped this worker: beats that went through further apart
        than their TTL (the event loop or Redis held up: under CPU contention the routers
        lost the worker for a moment), or a purge."""
        wid = self.info().worker_id
        if gap_s > self.beat_ttl_s:
            logger.warning("worker %s had dropped out of the registry: its heartbeats went "
                           "through %.2f s apart, past their %.2f s TTL (every %.2f s asked: "
                           "its event loop or Redis was held up)", wid, gap_s,
                           self.beat_ttl_s, self.interval_s)
        else:
            logger.warning("worker %s had been dropped from the registry (a purge?)", wid)

    async def _republish_now(self, dropped: bool, why: str | None = None) -> None:
        if self.republish is None:
            return
        why = why or ("Redis answers again" if self._lost
                      else "this worker had been dropped from it" if dropped
                      else "KV events were lost")
        async with self._publishing:
            self._events_lost = False
            await self.republish(self.registry)
        logger.info("registry entries republished (%s)", why)

    async def _flush(self) -> None:
        wid = self.info().worker_id
        while not self._stopping:
            await self._have_events.wait()
            async with self._publishing:
                self._have_events.clear()
                events, self._events = self._events, []
                if self._left:
                    # Deregistered: block events would list its cache in the prefix index
                    # again, with nothing left to remove them.
                    events = [ev for ev in events if is_ledger_event(ev)]
                try:
                    stored = await self.registry.publish_events(wid, events)
                except Exception as e:  # noqa: BLE001
                    logger.warning("publishing %d KV events failed: %s", len(events), e)
                    self._events_lost = True
                    continue
                if not stored and not self._events_lost:
                    # Purged as stale while alive: Redis took no block under an id it lists
                    # no heartbeat for. The next beat registers it again and republishes.
                    logger.info("worker %s is not registered: its stored blocks wait for its "
                                "next heartbeat's republish", wid)
                self._events_lost = self._events_lost or not stored

    async def leave(self) -> None:
        """Leaves routing for a drain: the heartbeat stops and the registration and
        prefix-index entries go, so routers send no more work. The KV handles stay (the
        decode workers' pulls of its leases read them), and so do the transfer-ledger
        entries, whose closes keep being published: the drain waits for those leases, an
        operator lists them, and a router restarted meanwhile under the id whose leases they
        are finds them to release. ``stop`` drops the rest after the drain. Bounded as
        ``stop`` is."""
        await stop_task(self._beat_task, _STOP_STEP_S)
        wid = self.info().worker_id
        try:
            async with asyncio.timeout(_STOP_STEP_S):  # not wait_for: client/tasks.py
                # Under the lock: a block event published after the purge would stay.
                async with self._publishing:
                    self._left = True
                    await self.registry.deregister(wid, keep_transfers=True)
        except Exception as e:  # noqa: BLE001 - stopping anyway; the heartbeat expires
            self._left = True
            logger.warning("leaving the registry failed: %r", e)

    async def stop(self) -> None:
        """Last (after ``leave`` and the drain, or instead of both): stops publishing and drops
        the worker's ledger entries, whose leases end with it, and its registration if it
        had not left. Bounded: a Redis that does not answer costs at most ``_STOP_STEP_S`` per
        step, and the worker then drops out of the registry when its heartbeat goes stale."""
        self._stopping = True
        for t in (self._beat_task, self._flush_task):
            await stop_task(t, _STOP_STEP_S)
        wid = self.info().worker_id
        try:
            async with asyncio.timeout(_STOP_STEP_S):  # not wait_for: client/tasks.py
                if self._left:  # its leases and KV handles stayed for the drain
                    await self.registry.ledger.forget_worker(wid)
                    await self.registry.set_kv_handles(wid, [])
                else:
                    await self.registry.deregister(wid)
        except Exception as e:  # noqa: BLE001 - stopping anyway; the heartbeat expires
            logger.warning("leaving the registry failed: %r", e)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(_STOP_STEP_S):
                await self.registry.r.aclose()
