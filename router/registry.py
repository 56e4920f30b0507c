"""The cluster's shared state in Redis: the worker registry and the prefix-block index.

Key schema (``ns`` is the namespace, default "pdserve"):

- ``{ns}:workers``              HASH  worker_id -> WorkerInfo (protobuf bytes, latest heartbeat)
- ``{ns}:heartbeats``           ZSET  worker_id -> unix time of its last heartbeat
- ``{ns}:drained``              SET   worker ids an admin drained (no new requests)
- ``{ns}:block:{hash_hex}``     SET   worker ids holding the block with that hash (prefill
                                      workers only: prompts are routed by prefix to them alone)
- ``{ns}:wblocks:{worker_id}``  SET   hash hexes the worker holds (to clean up after it)
- the transfer ledger's keys: router/ledger.py

A worker is live while its heartbeat is younger than the TTL; a stale worker drops out of
``live_workers`` without anyone deregistering it, and its index entries are purged lazily.
"""
from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from engine.block_pool import BlockRemoved, BlockStored
from protos import common_pb2
from router.ledger import TransferLedger
from router.redis_bound import REDIS_TIMEOUT_S, bounded

ROLES = ("prefill", "decode")
# Blocks per prefix-match round trip: a long prompt's chain is walked in pieces, stopping at
# the first piece where no candidate still matches.
_MATCH_CHUNK = 256
# Walks block keys in chain order on the server: per candidate worker (ARGV), how many leading
# blocks it holds. One command per chunk instead of one SMEMBERS per block: the router's
# prefix lookup for a 31-block prompt took ~1 ms of client-side pipelining before.
_MATCH_LUA = """
local alive, count = {}, {}
for _, w in ipairs(ARGV) do alive[w] = true; count[w] = 0 end
for i, key in ipairs(KEYS) do
  local still, any = {}, false
  for w, _ in pairs(alive) do
    if redis.call('SISMEMBER', key, w) == 1 then still[w] = true; count[w] = i; any = true end
  end
  alive = still
  if not any then break end
end
local out = {}
for _, w in ipairs(ARGV) do out[#out + 1] = count[w] end
return out
"""

# Heartbeats are stamped, and judged stale, by Redis's clock: workers and routers on other
# hosts may disagree by more than the TTL, and a worker whose clock runs behind would be
# purged at every refresh. replicate_commands: older Redis refuses a write after TIME without.
_HEARTBEAT_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local added = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], string.format('%.6f', t[1] + t[2] / 1000000), ARGV[1])
return {added, redis.call('SISMEMBER', KEYS[3], ARGV[1])}
"""
_STALE_LUA = """
local t = redis.call('TIME')
local cutoff = t[1] + t[2] / 1000000 - tonumber(ARGV[1])
return redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%.6f', cutoff))
"""

# An admin's drain lands only on a registered worker, checked in the same step: one that
# deregistered between a check and the write would leave its id drained, and the next worker
# registered under it (ids are role-port) would start drained.
_DRAIN_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_redis_url(url) -> str:
    """A URL redis-py connects with; ValueError naming it otherwise."""
    if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"redis_url must be a redis:// URL, got {url!r}")
    return url


# How stale a heartbeat the routers take for a worker gone (Registry.ttl_s's default).
ROUTER_TTL_S = 5.0


@dataclass(frozen=True)
class Heartbeat:
    # The worker was not registered: new, or dropped since its last beat (purged as stale,
    # or a new empty Redis), with its index entries, KV handles and drain flag.
    dropped: bool
    drained: bool  # an admin drained it (as Redis has it after this beat)


class Registry:
    def __init__(self, client: aioredis.Redis, namespace: str = "pdserve",
                 ttl_s: float = ROUTER_TTL_S) -> None:
        if not namespace or ":" in namespace:
            raise ValueError(f"namespace must be non-empty without ':', got {namespace!r}")
        self.r = client
        self.ns = namespace
        self.ttl_s = ttl_s
        self._match = client.register_script(_MATCH_LUA)
        self._beat = client.register_script(_HEARTBEAT_LUA)
        self._stale = client.register_script(_STALE_LUA)
        self._drain = client.register_script(_DRAIN_LUA)
        self.ledger = TransferLedger(self)

    @classmethod
    def from_url(cls, url: str, namespace: str = "pdserve",
                 ttl_s: float = ROUTER_TTL_S) -> Registry:
        # socket_timeout None: redis-py's default (5 s) would await writes through
        # asyncio.wait_for; each call is bounded by router/redis_bound.py instead.
        return cls(aioredis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                     socket_timeout=None), namespace, ttl_s)

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # --- workers --------------------------------------------------------------------------
    @bounded
    async def heartbeat(self, info: common_pb2.WorkerInfo) -> Heartbeat:
        """Registers or refreshes a worker (its load travels with the heartbeat)."""
        if info.role not in ROLES or not info.worker_id:
            raise ValueError(f"bad worker info: role {info.role!r}, id {info.worker_id!r}")
        added, drained = await self._beat(
            keys=[self._k("workers"), self._k("heartbeats"), self._k("drained")],
            args=[info.worker_id, info.SerializeToString()])
        return Heartbeat(dropped=bool(added), drained=bool(drained))

    @bounded
    async def deregister(self, worker_id: str) -> None:
        await self._purge([worker_id])

    @bounded
    async def live_workers(self, role: str | None = None) -> list[common_pb2.WorkerInfo]:
        stale = await self._stale(keys=[self._k("heartbeats")], args=[self.ttl_s])
        if stale:
            await self._purge([s.decode() for s in stale])
        raw = await self.r.hgetall(self._k("workers"))
        drained = {d.decode() for d in await self.r.smembers(self._k("drained"))}
        out = []
        for wid, blob in sorted(raw.items()):
            info = common_pb2.WorkerInfo.FromString(blob)
            info.draining = info.draining or info.worker_id in drained
            if role is None or info.role == role:
                out.append(info)
        return out

    @bounded
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        """Whether it changed anything: a drain lands only on a registered worker; an undrain
        clears the flag of any id (also one whose worker is gone)."""
        if drained:
            return bool(await self._drain(keys=[self._k("workers"), self._k("drained")],
                                          args=[worker_id]))
        return bool(await self.r.srem(self._k("drained"), worker_id))

    async def _purge(self, worker_ids: list[str]) -> None:
        for wid in worker_ids:
            await self._forget_blocks(wid)
            await self.ledger.forget_worker(wid)
            async with self.r.pipeline(transaction=True) as p:
                p.hdel(self._k("workers"), wid)
                p.zrem(self._k("heartbeats"), wid)
                p.srem(self._k("drained"), wid)
                p.delete(self._k("kvhandles", wid))
                await p.execute()

    # --- KV agents ------------------------------------------------------------------------
    @bounded
    async def set_kv_handles(self, worker_id: str, handles: list[bytes]) -> None:
        """A prefill worker's ranks' KV-agent handles (kvtransfer.KVAgentHandle bytes), so
        decode workers can connect before their first pull; gone when the worker is purged."""
        key = self._k("kvhandles", worker_id)
        async with self.r.pipeline(transaction=True) as p:
            p.delete(key)
            if handles:
                p.rpush(key, *handles)
            await p.execute()

    @bounded
    async def kv_handles(self, worker_id: str) -> list[bytes]:
        return list(await self.r.lrange(self._k("kvhandles", worker_id), 0, -1))

    # --- prefix-block index ---------------------------------------------------------------
    @bounded
    async def publish_events(self, worker_id: str, events: list) -> None:
        """Applies a worker's engine KV-cache events and its transfer-ledger events
        (router/ledger.py) in one pipeline, in order."""
        if not events:
            return
        wkey = self._k("wblocks", worker_id)
        async with self.r.pipeline(transaction=False) as p:
            for ev in events:
                if isinstance(ev, BlockStored):
                    hexes = [h.hex() for h in ev.block_hashes]
                    for hx in hexes:
                        p.sadd(self._k("block", hx), worker_id)
                    p.sadd(wkey, *hexes)
                elif isinstance(ev, BlockRemoved):
                    hexes = [h.hex() for h in ev.block_hashes]
                    for hx in hexes:
                        p.srem(self._k("block", hx), worker_id)
                    p.srem(wkey, *hexes)
                elif not self.ledger.queue(p, worker_id, ev):
                    raise TypeError(f"not a KV-cache or ledger event: {ev!r}")
            await p.execute()

    @bounded
    async def set_worker_blocks(self, worker_id: str, block_hashes: list[bytes]) -> None:
        """Replaces what the index says ``worker_id`` holds with exactly ``block_hashes``."""
        await self._forget_blocks(worker_id)
        if not block_hashes:
            return
        hexes = [h.hex() for h in block_hashes]
        async with self.r.pipeline(transaction=False) as p:
            for hx in hexes:
                p.sadd(self._k("block", hx), worker_id)
            p.sadd(self._k("wblocks", worker_id), *hexes)
            await p.execute()

    @bounded
    async def clear_worker(self, worker_id: str) -> None:
        """A worker (re)starting with an empty cache drops whatever it held before: its
        prefix-index entries, and its transfer-ledger entries (their leases died with it)."""
        await self._forget_blocks(worker_id)
        await self.ledger.forget_worker(worker_id)

    async def _forget_blocks(self, worker_id: str) -> None:
        wkey = self._k("wblocks", worker_id)
        hexes = [h.decode() for h in await self.r.smembers(wkey)]
        async with self.r.pipeline(transaction=False) as p:
            for hx in hexes:
                p.srem(self._k("block", hx), worker_id)
            p.delete(wkey)
            await p.execute()

    @bounded
    async def match_prefix(self, block_hashes: list[bytes],
                           worker_ids: list[str]) -> dict[str, int]:
        """Per worker, how many LEADING blocks of the chain it holds (0 if none)."""
        matched = {w: 0 for w in worker_ids}
        alive = list(dict.fromkeys(worker_ids))
        for start in range(0, len(block_hashes), _MATCH_CHUNK):
            if not alive:
                break
            chunk = block_hashes[start:start + _MATCH_CHUNK]
            counts = await self._match(keys=[self._k("block", h.hex()) for h in chunk],
                                       args=alive)
            for w, n in zip(alive, counts):
                if n:
                    matched[w] = start + int(n)
            alive = [w for w, n in zip(alive, counts) if int(n) == len(chunk)]
        return matched
