"""The transfer ledger in Redis: every prompt KV held for a transfer, cluster-wide.

A prefill worker keeps a prompt's blocks under a lease from its Prefill answer until the decode
worker's pull releases them (or the router's ReleaseKV, or the lease's expiry). Each lease is
known to that worker alone; the ledger puts them where every router can read them, so an
operator sees what KV is held where, for whom, by which reader, and for how long (``pdserve
admin transfers``), and a router restarted under the same id releases at once what its
predecessor left leased (router/router_presence.py) instead of waiting out the leases.

Writers, all batched into the pipelines that already carry the prefix-cache events
(``Registry.publish_events``), never on a request's path:

- the prefill worker opens an entry when it answers Prefill with a KV handle
  (``TransferOpened``) and closes it when the lease ends (``engine.outputs.LeaseEnded``);
- the decode worker marks the entry when its pull begins (``TransferPulling``); the mark only
  updates an entry that still exists, so a late one never brings a closed entry back.

Key schema (``ns`` is the registry's namespace):

- ``{ns}:xfer:{n}:{worker_id}:{request_id}``  HASH  the entry (``n`` = len(worker_id), so any
                                              pair of ids maps to one key); Redis expires it
                                              with the lease, plus a margin
- ``{ns}:xfers``                              ZSET  entry key -> lease expiry (unix time)
- ``{ns}:routers``                            ZSET  router id -> its last heartbeat (unix time)
- ``{ns}:router_incarnations``                HASH  router id -> the incarnation beating for it
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.outputs import LeaseEnded

# Entries outlive their lease's expiry by this much in Redis before Redis drops them: a
# worker's clock ahead of Redis's readers must not hide a live entry.
EXPIRY_MARGIN_S = 5.0
DEFAULT_LIST_LIMIT = 1000

_MARK_PULLING_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('HSET', KEYS[1], 'decode_worker_id', ARGV[1], 'pull_started_at', ARGV[2])
  return 1
end
return 0
"""


@dataclass(frozen=True)
class TransferOpened:
    """A prefill worker leased a prompt's KV for a reader (its Prefill answer carries it)."""

    request_id: str  # the id the prefill worker knows the request by
    router_id: str
    router_incarnation: str
    prefill_address: str
    num_blocks: int
    num_tokens: int
    leased_at: float  # unix time
    expires_at: float  # unix time


@dataclass(frozen=True)
class TransferPulling:
    """A decode worker began pulling a lease's blocks from ``prefill_worker_id``."""

    prefill_worker_id: str
    request_id: str
    decode_worker_id: str
    started_at: float  # unix time


@dataclass
class LedgerEntry:
    prefill_worker_id: str
    request_id: str
    router_id: str
    router_incarnation: str
    prefill_address: str
    num_blocks: int
    num_tokens: int
    leased_at: float
    expires_at: float
    decode_worker_id: str = ""
    pull_started_at: float = 0.0

    @property
    def state(self) -> str:
        return "pulling" if self.decode_worker_id else "leased"


def entry_key(ns: str, worker_id: str, request_id: str) -> str:
    return f"{ns}:xfer:{len(worker_id)}:{worker_id}:{request_id}"


class TransferLedger:
    """The ledger's reads and writes on a Registry's Redis connection and namespace."""

    def __init__(self, registry) -> None:
        self.r = registry.r
        self.ns = registry.ns

    @property
    def index_key(self) -> str:
        return f"{self.ns}:xfers"

    # --- writes, queued on a pipeline of Registry.publish_events -------------------------
    def queue(self, p, worker_id: str, ev) -> bool:
        """Queues ``ev``'s writes on pipeline ``p``; False if ``ev`` is no ledger event."""
        if isinstance(ev, TransferOpened):
            key = entry_key(self.ns, worker_id, ev.request_id)
            p.hset(key, mapping={
                "prefill_worker_id": worker_id, "request_id": ev.request_id,
                "router_id": ev.router_id, "router_incarnation": ev.router_incarnation,
                "prefill_address": ev.prefill_address, "num_blocks": ev.num_blocks,
                "num_tokens": ev.num_tokens, "leased_at": repr(ev.leased_at),
                "expires_at": repr(ev.expires_at)})
            p.pexpireat(key, int((ev.expires_at + EXPIRY_MARGIN_S) * 1000))
            p.zadd(self.index_key, {key: ev.expires_at})
        elif isinstance(ev, LeaseEnded):
            key = entry_key(self.ns, worker_id, ev.request_id)
            p.delete(key)
            p.zrem(self.index_key, key)
        elif isinstance(ev, TransferPulling):
            key = entry_key(self.ns, ev.prefill_worker_id, ev.request_id)
            # EVAL, not a registered script: those await a load of their own on a pipeline.
            p.eval(_MARK_PULLING_LUA, 1, key, ev.decode_worker_id, repr(ev.started_at))
        else:
            return False
        return True

    async def forget_worker(self, worker_id: str) -> None:
        """Drops a worker's entries (it stopped or went stale: its leases died with it)."""
        prefix = entry_key(self.ns, worker_id, "")
        keys = [k.decode() for k in await self.r.zrange(self.index_key, 0, -1)]
        mine = [k for k in keys if k.startswith(prefix)]
        if mine:
            async with self.r.pipeline(transaction=False) as p:
                p.delete(*mine)
                p.zrem(self.index_key, *mine)
                await p.execute()

    # --- reads ----------------------------------------------------------------------------
    async def entries(self, limit: int = DEFAULT_LIST_LIMIT) -> tuple[list[LedgerEntry], int]:
        """The live entries, those expiring first, at most ``limit``; and how many more."""
        now = time.time()
        # Index members whose entry Redis expired (a worker that died before closing them).
        await self.r.zremrangebyscore(self.index_key, "-inf", f"({now - EXPIRY_MARGIN_S}")
        total = await self.r.zcard(self.index_key)
        keys = await self.r.zrange(self.index_key, 0, limit - 1)
        async with self.r.pipeline(transaction=False) as p:
            for k in keys:
                p.hgetall(k)
            raws = await p.execute()
        out, gone = [], []
        for k, raw in zip(keys, raws):
            if not raw:
                gone.append(k)
                continue
            out.append(_entry(raw))
        if gone:
            await self.r.zrem(self.index_key, *gone)
        return out, max(total - len(keys), 0)

    # --- routers --------------------------------------------------------------------------
    async def router_beat(self, router_id: str, incarnation: str) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.zadd(f"{self.ns}:routers", {router_id: time.time()})
            p.hset(f"{self.ns}:router_incarnations", router_id, incarnation)
            await p.execute()

    async def router_leave(self, router_id: str, incarnation: str) -> None:
        """Removes the router's heartbeat if it is still this incarnation's."""
        held = await self.r.hget(f"{self.ns}:router_incarnations", router_id)
        if held is not None and held.decode() == incarnation:
            async with self.r.pipeline(transaction=True) as p:
                p.zrem(f"{self.ns}:routers", router_id)
                p.hdel(f"{self.ns}:router_incarnations", router_id)
                await p.execute()

    async def router_heartbeat(self, router_id: str) -> tuple[str, float] | None:
        """(incarnation, last heartbeat) of the router beating for ``router_id``, if any."""
        async with self.r.pipeline(transaction=False) as p:
            p.zscore(f"{self.ns}:routers", router_id)
            p.hget(f"{self.ns}:router_incarnations", router_id)
            beat, inc = await p.execute()
        if beat is None or inc is None:
            return None
        return inc.decode(), float(beat)

    async def live_routers(self, ttl_s: float) -> set[str]:
        cutoff = time.time() - ttl_s
        return {r.decode() for r in await self.r.zrangebyscore(f"{self.ns}:routers",
                                                               f"({cutoff}", "+inf")}


def _entry(raw: dict) -> LedgerEntry:
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return LedgerEntry(
        prefill_worker_id=f.get("prefill_worker_id", ""), request_id=f.get("request_id", ""),
        router_id=f.get("router_id", ""), router_incarnation=f.get("router_incarnation", ""),
        prefill_address=f.get("prefill_address", ""), num_blocks=int(f.get("num_blocks", 0)),
        num_tokens=int(f.get("num_tokens", 0)), leased_at=float(f.get("leased_at", 0)),
        expires_at=float(f.get("expires_at", 0)),
        decode_worker_id=f.get("decode_worker_id", ""),
        pull_started_at=float(f.get("pull_started_at", 0)))
