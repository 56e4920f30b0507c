"""A decode worker connects to the cluster's prefill workers' KV agents before it needs them.

Prefill workers publish their ranks' KV-agent handles in the registry when they start
(router.registry.Registry.set_kv_handles). A decode worker's first pull from a new peer would
otherwise load the peer's metadata and open the UCX connection on the request's path: 29 ms
for a 2-block pull on the 2-core VM, 4.5 ms once connected. This loop watches the registry
and connects to every live prefill worker it has not seen, off the event loop.

Each new peer's KV-handle key, read with its handles, is passed on (``on_source``: the decode
service's decode_svc/kv_sources.py): a pull from a peer met this way verifies its handle
without asking Redis, so a Redis outage or restart does not fail the first pull from each
prefill worker (each such request was moved, its migrations spent in a fraction of a second on
the same refusal, and failed UNAVAILABLE: 25 of 4,942 requests in a 10-minute chaos soak
with 9 Redis restarts or hangs).

It also lets go of prefill workers that left: each connection holds sockets, a process group
or a loaded NIXL agent and its UCX endpoints, so a long-lived decode worker would otherwise
grow with every prefill restart. A peer is dropped once gone from the registry for
``FORGET_AFTER_S``, not at once: a worker purged for a late heartbeat comes back with the
same agents, and its leases may still be read meanwhile.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from client.tasks import stop_task
from kvtransfer import KVAgentHandle

logger = logging.getLogger(__name__)
# Longer than a prefill lease (20 s by default) and than a registry purge's flap.
FORGET_AFTER_S = 60.0


class KVPeerConnector:
    def __init__(self, registry, llm, interval_s: float,
                 on_source: Callable[[str, list[bytes], bytes], None] | None = None) -> None:
        self.registry = registry
        self.llm = llm  # engine.llm_engine.LLMEngine (decode role, with a KV transfer backend)
        self.interval_s = interval_s
        # Told (worker id, rank handles, key) of each prefill worker met with a key.
        self.on_source = on_source
        # Peers by their agents' names: a prefill worker restarted under the same id has new
        # agents and is connected again.
        self._tried: set[tuple[str, ...]] = set()
        # Those connected ahead, until any of their agents is forgotten (a gauge).
        self._connected: set[tuple[str, ...]] = set()
        # Agent names held (met in the registry, or the engine reported them) and, for those
        # gone from the registry, since when.
        self._held: set[str] = set()
        self._missing_since: dict[str, float] = {}
        self._next_census = 0.0
        self.num_forgotten = 0
        self._task: asyncio.Task | None = None
        self._stopping = False

    @property
    def num_connected(self) -> int:
        """Prefill workers (their sets of agents) connected ahead and not forgotten since."""
        return len(self._connected)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        # Checked each round, so the loop stops even if a cancel is swallowed (client/tasks.py).
        self._stopping = True
        await stop_task(self._task)
        self._task = None

    async def _loop(self) -> None:
        while not self._stopping:
            try:
                await self.connect_new()
            except Exception as e:  # noqa: BLE001 - Redis away: the next round retries
                logger.warning("looking for prefill workers to connect to failed: %s", e)
            await asyncio.sleep(self.interval_s)

    async def connect_new(self) -> None:
        """One round: connects to each live prefill worker not tried yet, and drops the
        peers gone long enough."""
        live: set[str] = set()
        for info in await self.registry.live_workers("prefill"):
            blobs, mac_key = await self.registry.kv_source(info.worker_id)
            if not blobs:
                continue  # not published (yet): the next round looks again
            await self._connect(info, blobs, mac_key, live)
        await self._forget_gone(live)

    async def _connect(self, info, blobs: list[bytes], mac_key: bytes, live: set[str]) -> None:
        try:
            handles = [KVAgentHandle.from_bytes(b) for b in blobs]
        except ValueError as e:
            logger.warning("prefill worker %s published unreadable KV handles: %s",
                           info.worker_id, e)
            return
        key = tuple(h.agent_name for h in handles)
        live.update(key)
        if key in self._tried:
            return
        self._tried.add(key)  # tried once: a peer that fails now fails on its pull too
        self._held.update(key)
        if mac_key and self.on_source is not None:
            self.on_source(info.worker_id, blobs, mac_key)
        try:
            if await asyncio.to_thread(self.llm.preconnect_kv, handles):
                self._connected.add(key)
        except Exception as e:  # noqa: BLE001 - the pull will connect (or fail) itself
            logger.warning("could not connect ahead to prefill worker %s: %s",
                           info.worker_id, e)

    async def _forget_gone(self, live: set[str]) -> None:
        now = time.monotonic()
        if now >= self._next_census:  # peers met only through a request's handle too
            self._next_census = now + FORGET_AFTER_S / 2
            self._held.update(await asyncio.to_thread(self.llm.kv_peer_names))
        for name in self._held:
            if name in live:
                self._missing_since.pop(name, None)
            else:
                self._missing_since.setdefault(name, now)
        due = sorted(n for n, t in self._missing_since.items() if now - t >= FORGET_AFTER_S)
        if not due:
            return
        busy = set(await asyncio.to_thread(self.llm.forget_kv_peers, due))
        gone = set(due) - busy  # a busy one is tried again next round
        for name in gone:
            self._held.discard(name)
            del self._missing_since[name]
        self._tried = {k for k in self._tried if not gone.intersection(k)}
        self._connected = {k for k in self._connected if not gone.intersection(k)}
        self.num_forgotten += len(gone)
        logger.info("dropped the KV connections to %d prefill agent(s) gone from the "
                    "registry: %s", len(gone), sorted(gone))
