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
- the decode worker marks the entry when its pull begins (``TransferPulling``). The mark is a
  key of its own, since the two workers' pipelines race: a mark that lands before the open
  still shows once the entry does, and one that lands after the close lists nothing (the
  listing walks the entries) and expires with the lease it named.

Key schema (``ns`` is the registry's namespace):

- ``{ns}:xfer:{n}:{worker_id}:{request_id}``  HASH  the entry (``n`` = len(worker_id), so any
                                              pair of ids maps to one key); Redis expires it
                                              a margin after its lease would have
- ``{ns}:xfers``                              ZSET  entry key -> lease expiry (the worker's
                                              unix time: an order for listing, not a clock
                                              anyone else trusts)
- ``{ns}:xpull:{n}:{worker_id}:{request_id}`` HASH  the decode worker pulling that entry's
                                              blocks, and the lease left when it began;
                                              Redis expires it with the lease
- ``{ns}:wxfers:{worker_id}``                 SET   a worker's entry keys (to drop them with it)
- ``{ns}:router:{router_id}``                 STRING the incarnation beating for the id;
                                              Redis expires it a TTL after its last beat

Every expiry is relative and counted by Redis's own clock, so no host's clock has to agree
with another's: a router judges another's liveness by whether its key still exists, and a
listing's ages and times to expiry come from what Redis has left of each key's TTL.

What a worker holds is its own to say: its republish (``TransferLedger.replace_worker``, after
a Redis restart, a purge of it, or a flush that failed) replaces its entries with the leases it
holds, so one lost (Redis forgot it) comes back and one whose close was lost goes. A stopping
worker keeps its entries, and publishes their closes, until its drain ends (router/presence.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from engine.outputs import LeaseEnded
from router.redis_bound import bounded

# Entries outlive their lease by this much in Redis: the open is published a moment after
# the lease began, and a listing should show a lease until its worker ends it.
EXPIRY_MARGIN_S = 5.0
DEFAULT_LIST_LIMIT = 1000
MAX_LIST_LIMIT = 10_000
# Index members checked per listing for entries Redis already expired.
_PRUNE_BATCH = 1000

# Sets the router id's key to ARGV[1] (expiring in ARGV[2] ms) if it is free, already ours,
# or held by ARGV[3], an incarnation the caller knows is gone; 0 if another holds it.
_CLAIM_ROUTER_LUA = """
local held = redis.call('GET', KEYS[1])
if held == false or held == ARGV[1] or (ARGV[3] ~= '' and held == ARGV[3]) then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""
_LEAVE_ROUTER_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
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
    # What is left of the lease as this is published, for a republish long after the lease
    # began; None: all of it (``expires_at - leased_at``).
    remaining_s: float | None = None

    @property
    def ttl_s(self) -> float:
        """How long Redis keeps the entry: the lease left, plus the margin."""
        left = self.expires_at - self.leased_at if self.remaining_s is None else self.remaining_s
        return max(left, 0.0) + EXPIRY_MARGIN_S


def is_ledger_event(ev) -> bool:
    return isinstance(ev, (TransferOpened, TransferPulling, LeaseEnded))


@dataclass(frozen=True)
class TransferPulling:
    """A decode worker began pulling a lease's blocks from ``prefill_worker_id``."""

    prefill_worker_id: str
    request_id: str
    decode_worker_id: str
    started_at: float  # unix time
    lease_timeout_s: float  # what the KV handle said was left of the lease


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
    pull_started_at: float = 0.0  # the decode worker's unix time
    # By Redis's clock, as read with the entry: what is left of the entry's TTL and of its
    # pull mark's, and the lease that was left when the pull began (its mark's TTL then, less
    # the margin; 0 for a mark that does not say).
    ttl_s: float = 0.0
    pull_ttl_s: float = 0.0
    pull_lease_s: float = 0.0

    @property
    def state(self) -> str:
        return "pulling" if self.decode_worker_id else "leased"

    # No host's clock but Redis's: a reader's wall clock minus a worker's stamp is off by
    # however far the two hosts disagree (minutes, on an unsynced host).
    @property
    def expires_in_s(self) -> float:
        """Until the lease ends: the entry's TTL less the margin it was given."""
        return max(self.ttl_s - EXPIRY_MARGIN_S, 0.0)

    @property
    def age_s(self) -> float:
        """Since the lease began: its length (two stamps of one worker's clock) less what is
        left of it (short by the moment its open took to reach Redis)."""
        return max(self.expires_at - self.leased_at - self.expires_in_s, 0.0)

    @property
    def pull_s(self) -> float:
        """Since the pull began (0 when none did, or its mark does not say): its mark's TTL
        as written less what Redis has left of it."""
        if not self.decode_worker_id or not self.pull_lease_s:
            return 0.0
        return max(self.pull_lease_s + EXPIRY_MARGIN_S - self.pull_ttl_s, 0.0)


def entry_key(ns: str, worker_id: str, request_id: str) -> str:
    return f"{ns}:xfer:{len(worker_id)}:{worker_id}:{request_id}"


def pull_key(entry: str | bytes) -> str:
    """The pull mark's key for an entry's key."""
    entry = entry.decode() if isinstance(entry, bytes) else entry
    head, _, rest = entry.partition(":xfer:")  # the namespace has no ":"
    return f"{head}:xpull:{rest}"


class TransferLedger:
    """The ledger's reads and writes on a Registry's Redis connection and namespace. The
    calls of its own (not the queued writes) are bounded like the Registry's."""

    def __init__(self, registry) -> None:
        self.r = registry.r
        self.ns = registry.ns
        self._claim_router = self.r.register_script(_CLAIM_ROUTER_LUA)
        self._leave_router = self.r.register_script(_LEAVE_ROUTER_LUA)

    @property
    def index_key(self) -> str:
        return f"{self.ns}:xfers"

    def _worker_key(self, worker_id: str) -> str:
        return f"{self.ns}:wxfers:{worker_id}"

    def _router_key(self, router_id: str) -> str:
        return f"{self.ns}:router:{router_id}"

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
            # The lease's length, not its end on the worker's clock: Redis's clock counts it.
            ttl_ms = int(ev.ttl_s * 1000)
            p.pexpire(key, ttl_ms)
            p.zadd(self.index_key, {key: ev.expires_at})
            p.sadd(self._worker_key(worker_id), key)
            p.pexpire(self._worker_key(worker_id), ttl_ms)  # a worker's leases share a length
        elif isinstance(ev, LeaseEnded):
            key = entry_key(self.ns, worker_id, ev.request_id)
            p.delete(key, pull_key(key))
            p.zrem(self.index_key, key)
            p.srem(self._worker_key(worker_id), key)
        elif isinstance(ev, TransferPulling):
            key = pull_key(entry_key(self.ns, ev.prefill_worker_id, ev.request_id))
            # The lease left rides along: what the mark's TTL began at, so a listing can tell
            # how long the pull has run from what Redis has left of it.
            p.hset(key, mapping={"decode_worker_id": ev.decode_worker_id,
                                 "pull_started_at": repr(ev.started_at),
                                 "pull_lease_s": repr(max(ev.lease_timeout_s, 0.0))})
            p.pexpire(key, int((max(ev.lease_timeout_s, 0.0) + EXPIRY_MARGIN_S) * 1000))
        else:
            return False
        return True

    @bounded
    async def forget_worker(self, worker_id: str) -> None:
        """Drops a worker's entries (it stopped, went stale or started again under its id:
        its leases died with it)."""
        wkey = self._worker_key(worker_id)
        keys = list(await self.r.smembers(wkey))
        async with self.r.pipeline(transaction=False) as p:
            if keys:
                p.delete(*keys, *(pull_key(k) for k in keys))
                p.zrem(self.index_key, *keys)
            p.delete(wkey)
            await p.execute()

    @bounded
    async def replace_worker(self, worker_id: str, held: list[TransferOpened]) -> None:
        """Makes the worker's entries exactly ``held`` (each with ``remaining_s`` set): its
        republish. Redis may have lost entries of leases it still holds (a restart, a purge of
        it) and kept ones whose close was lost (a failed flush). The worker publishes no
        ledger event meanwhile (router/presence.py), so none lands between the read and the
        write. The pull marks of leases still held stay: a router's reclaim leaves a lease
        being pulled alone, and the decode worker does not write its mark again."""
        wkey = self._worker_key(worker_id)
        keep = {entry_key(self.ns, worker_id, ev.request_id).encode() for ev in held}
        gone = [k for k in await self.r.smembers(wkey) if k not in keep]
        async with self.r.pipeline(transaction=True) as p:
            if gone:
                p.delete(*gone, *(pull_key(k) for k in gone))
                p.zrem(self.index_key, *gone)
            p.delete(wkey)
            # Longest last: each open sets the worker's set's expiry to its own TTL.
            for ev in sorted(held, key=lambda ev: ev.ttl_s):
                self.queue(p, worker_id, ev)
            await p.execute()

    # --- reads ----------------------------------------------------------------------------
    @bounded
    async def entries(self, limit: int = DEFAULT_LIST_LIMIT,
                      offset: int = 0) -> tuple[list[LedgerEntry], int]:
        """The live entries, those expiring first, at most ``limit`` after the first
        ``offset`` in the index; and how many more."""
        if not 0 < limit <= MAX_LIST_LIMIT:
            raise ValueError(f"limit must be in [1, {MAX_LIST_LIMIT}], got {limit}")
        if offset == 0:
            await self._prune()
        total = await self.r.zcard(self.index_key)
        keys = await self.r.zrange(self.index_key, offset, offset + limit - 1)
        async with self.r.pipeline(transaction=False) as p:
            for k in keys:
                p.hgetall(k)
                p.hgetall(pull_key(k))
                p.pttl(k)
                p.pttl(pull_key(k))
            raws = await p.execute()
        out, gone = [], []
        for k, raw, pull, ttl, pull_ttl in zip(keys, *(raws[i::4] for i in range(4))):
            if not raw:
                gone.append(k)
                continue
            out.append(_entry({**raw, **pull}, ttl, pull_ttl))
        if gone:
            await self.r.zrem(self.index_key, *gone)
        return out, max(total - offset - len(keys), 0)

    async def _prune(self) -> None:
        """Drops index members whose entry Redis expired (a worker that died before closing
        them). Members past their expiry by this reader's clock are only candidates: each is
        dropped if its entry is gone, so a clock ahead of the worker's hides nothing."""
        await self._drop_gone(await self.r.zrangebyscore(
            self.index_key, "-inf", f"({time.time() - EXPIRY_MARGIN_S}", 0, _PRUNE_BATCH))

    @bounded
    async def sweep(self, cursor: int = 0) -> int:
        """One step of a walk over the whole index, dropping members whose entry Redis
        expired, whatever their score; the cursor of the next step (0: the walk is over).
        A listing prunes only what its reader's clock says expired, and only when someone
        lists: an entry whose close was lost (a worker that left for a drain, then died, is
        purged by no router) would stay in the index for good, and a worker's clock running
        ahead keeps its dead entries out of a listing's prune."""
        cursor, members = await self.r.zscan(self.index_key, cursor, count=_PRUNE_BATCH)
        await self._drop_gone([k for k, _ in members])
        return int(cursor)

    async def _drop_gone(self, keys: list) -> None:
        if not keys:
            return
        async with self.r.pipeline(transaction=False) as p:
            for k in keys:
                p.exists(k)
            alive = await p.execute()
        gone = [k for k, a in zip(keys, alive) if not a]
        if gone:
            await self.r.zrem(self.index_key, *gone)

    # --- routers --------------------------------------------------------------------------
    @bounded
    async def router_claim(self, router_id: str, incarnation: str, ttl_s: float,
                           replacing: str = "") -> bool:
        """Beats for ``router_id`` as ``incarnation`` for ``ttl_s``; False, writing nothing,
        if another incarnation holds the id (``replacing``, one known to be gone, excepted)."""
        return bool(await self._claim_router(keys=[self._router_key(router_id)],
                                             args=[incarnation, int(ttl_s * 1000), replacing]))

    @bounded
    async def router_leave(self, router_id: str, incarnation: str) -> bool:
        """Ends the router's heartbeat if it is still this incarnation's (True then)."""
        return bool(await self._leave_router(keys=[self._router_key(router_id)],
                                             args=[incarnation]))

    @bounded
    async def router_holder(self, router_id: str) -> str | None:
        """The incarnation beating for ``router_id``, if its heartbeat has not expired."""
        held = await self.r.get(self._router_key(router_id))
        return held.decode() if held is not None else None

    @bounded
    async def live_routers(self, router_ids) -> set[str]:
        """Those of ``router_ids`` whose heartbeat has not expired."""
        return set(await self.router_holders(router_ids))

    @bounded
    async def router_holders(self, router_ids) -> dict[str, str]:
        """Of ``router_ids`` whose heartbeat has not expired, the incarnation beating for
        each: a lease's router lives only if the incarnation that took it still beats (a
        successor under its id may not have been able to release it)."""
        ids = sorted(set(router_ids))
        if not ids:
            return {}
        held = await self.r.mget([self._router_key(r) for r in ids])
        return {r: h.decode() for r, h in zip(ids, held) if h is not None}


def _entry(raw: dict, ttl_ms: int, pull_ttl_ms: int) -> LedgerEntry:
    """``ttl_ms``, ``pull_ttl_ms``: Redis's PTTL of the entry and of its pull mark (negative
    for none)."""
    f = {k.decode(): v.decode() for k, v in raw.items()}
    return LedgerEntry(
        prefill_worker_id=f.get("prefill_worker_id", ""), request_id=f.get("request_id", ""),
        router_id=f.get("router_id", ""), router_incarnation=f.get("router_incarnation", ""),
        prefill_address=f.get("prefill_address", ""), num_blocks=int(f.get("num_blocks", 0)),
        num_tokens=int(f.get("num_tokens", 0)), leased_at=float(f.get("leased_at", 0)),
        expires_at=float(f.get("expires_at", 0)),
        decode_worker_id=f.get("decode_worker_id", ""),
        pull_started_at=float(f.get("pull_started_at", 0)),
        ttl_s=max(ttl_ms, 0) / 1000, pull_ttl_s=max(pull_ttl_ms, 0) / 1000,
        pull_lease_s=float(f.get("pull_lease_s", 0)))
