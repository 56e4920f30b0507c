"""The cluster's shared state in Redis: the worker registry and the prefix-block index.

Key schema (``ns`` is the namespace, default "pdserve"):

- ``{ns}:workers``              HASH  worker_id -> WorkerInfo (protobuf bytes, latest heartbeat)
- ``{ns}:heartbeats``           ZSET  worker_id -> unix time of its last heartbeat
- ``{ns}:drained``              SET   worker ids an admin drained (no new requests)
- ``{ns}:ttls``                 HASH  worker_id -> seconds it may go without a heartbeat before
                                      it is taken for gone, as the worker declared (optional)
- ``{ns}:purged:{worker_id}``   STRING "1"/"0": whether an admin had drained a worker when it
                                      was purged, for its return; expires after an hour
- ``{ns}:block:{hash_hex}``     SET   worker ids holding the block with that hash (both roles:
                                      prefill workers by prefix, decode workers for the reuse
                                      of their cache, router/local_prefill.py)
- ``{ns}:wblocks:{worker_id}``  SET   hash hexes the worker holds (to clean up after it)
- ``{ns}:kvhandles:{worker_id}`` LIST a prefill worker's ranks' KV-agent handles, then the
                                      key it signs its KV handles with (tagged); expires an
                                      hour after its last heartbeat
- the transfer ledger's keys: router/ledger.py
- the routers beating in the namespace: router/router_peers.py

A worker is live while its heartbeat is younger than the reader's TTL or its own, whichever is
longer; a stale worker drops out of ``live_workers`` without anyone deregistering it, and its
index entries are purged lazily. An entry that does not parse is dropped, never raised: one bad
value must not blind every router.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlparse

import redis.asyncio as aioredis
from redis.connection import parse_url
from google.protobuf.message import DecodeError

from engine.block_pool import BlockRemoved, BlockStored
from protos import common_pb2
from router.ledger import TransferLedger
from router.redis_bound import REDIS_TIMEOUT_S, bounded
from router.redis_database import DatabaseWatch, redacted

logger = logging.getLogger(__name__)

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
# KEYS: workers, heartbeats, drained, ttls, purged:{id}, kvhandles:{id}. ARGV: id, info, own
# TTL ('' for none), '1' if the worker last knew itself drained, the KV handles' TTL in ms.
# Returns: whether it registered the worker, whether it is drained, whether a purge's
# tombstone was found (a purge ended since the worker's last beat, or since it cleared its id).
_HEARTBEAT_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local added = redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZADD', KEYS[2], string.format('%.6f', t[1] + t[2] / 1000000), ARGV[1])
if ARGV[3] == '' then redis.call('HDEL', KEYS[4], ARGV[1])
else redis.call('HSET', KEYS[4], ARGV[1], ARGV[3]) end
local purged = 0
if added == 1 then
  -- Registered again. A purge left the admin's last decision in a tombstone; without one,
  -- Redis forgot it (a restart) and the worker's own last word stands.
  local kept = redis.call('GET', KEYS[5])
  if kept then redis.call('DEL', KEYS[5]); purged = 1 end
  if (kept or ARGV[4]) == '1' then redis.call('SADD', KEYS[3], ARGV[1]) end
end
redis.call('PEXPIRE', KEYS[6], ARGV[5])
return {added, redis.call('SISMEMBER', KEYS[3], ARGV[1]), purged}
"""
# A worker silent for ``age`` seconds is gone if longer than the reader's TTL and than its own,
# if it declared one: a reader that waits less than a worker said it may stay silent (a decode
# worker beating fast, reading a prefill worker that beats slowly) must not take it for gone.
# One rule for the stale read and the purge's last step, which must agree.
_IS_STALE_LUA = """
local function is_stale(age, reader_ttl, own)
  return age > reader_ttl and (own == nil or age > own)
end
"""
# Workers stale by the reader's TTL (ARGV[1]) and their own (KEYS[2]).
_STALE_LUA = _IS_STALE_LUA + """
local t = redis.call('TIME')
local now = t[1] + t[2] / 1000000
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf',
                       '(' .. string.format('%.6f', now - tonumber(ARGV[1])), 'WITHSCORES')
local out = {}
for i = 1, #old, 2 do
  local own = tonumber(redis.call('HGET', KEYS[2], old[i]))
  if is_stale(now - tonumber(old[i + 1]), tonumber(ARGV[1]), own) then
    out[#out + 1] = old[i]
  end
end
return out
"""

# An admin's drain lands only on a registered worker, checked in the same step: one that
# deregistered between a check and the write would leave its id drained, and the next worker
# registered under it (ids are role-port) would start drained.
_DRAIN_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('SADD', KEYS[2], ARGV[1])
return 1
"""
# An undrain also overrules the drain a purged worker's tombstone keeps for its return.
# KEYS: drained, purged:{id}.
_UNDRAIN_LUA = """
local n = redis.call('SREM', KEYS[1], ARGV[1])
if redis.call('GET', KEYS[2]) == '1' then
  redis.call('SET', KEYS[2], '0', 'KEEPTTL')
  n = 1
end
return n
"""
# Drops a worker's registration. A registered one leaves a tombstone with the admin's drain
# decision: a purged worker that lives (its beat came late) registers again and takes that
# back, not its own copy, which misses a decision made since its last beat.
# Its heartbeat entry goes only if still stale by the purging reader's TTL (ARGV[4]; '' for a
# deregister) and its own: a beat that landed during the purge's earlier steps registered the
# worker again, and the blocks it republished then may have been forgotten since. It is
# dropped again (its next beat republishes once more), but a later purge still finds it, and
# what it republished, should it die before that beat.
# KEYS: workers, heartbeats, drained, ttls, kvhandles:{id}, purged:{id}. ARGV: id, expiry ms,
# "1" to drop the KV handles too, the reader's TTL.
_PURGE_LUA = _IS_STALE_LUA + """
redis.replicate_commands()
local drained = redis.call('SREM', KEYS[3], ARGV[1])
local known = redis.call('HDEL', KEYS[1], ARGV[1])
local beat = redis.call('ZSCORE', KEYS[2], ARGV[1])
local fresh = false
if beat then
  known = known + 1
  if ARGV[4] ~= '' then
    local t = redis.call('TIME')
    local age = t[1] + t[2] / 1000000 - tonumber(beat)
    local own = tonumber(redis.call('HGET', KEYS[4], ARGV[1]))
    fresh = not is_stale(age, tonumber(ARGV[4]), own)
  end
end
if not fresh then
  redis.call('ZREM', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[4], ARGV[1])
end
if ARGV[3] == '1' then redis.call('DEL', KEYS[5]) end
if known > 0 then redis.call('SET', KEYS[6], drained, 'PX', ARGV[2]) end
return known
"""
# Long enough for a purged worker that lives to beat again; a dead one's goes by itself.
_PURGED_TTL_S = 3600.0
# A prefill worker's KV handles expire this long after its last beat (each beat sets it
# again): one that died after writing them and before its first beat went through is purged
# by nobody. A live worker silent for this long lost its registration too, and republishes.
KV_HANDLES_TTL_S = 3600.0
# Marks the KV handles' key among a worker's rank handles (JSON objects: they start with "{").
_MAC_KEY_TAG = b"mac-key:"

# The prefix index keeps a worker's blocks twice: in each block's key and in its wblocks set.
# Every write changes both for a block in one step (these scripts, and publish_events'
# transaction): a forget that read the wblocks set, then dropped the keys it listed, let a KV
# event land in between and leave a block key naming the worker that its wblocks set no
# longer lists, which no later forget finds (orphaned for good). A chunk of blocks per step,
# not the whole set: a worker holds up to some 10^5 blocks, and one script over them all
# stalls every router's lookups for most of a second.
_BLOCKS_PER_STEP = 2000
# Forgets up to ARGV[3] of a worker's blocks; how many it forgot. KEYS[1]: wblocks:{id}.
# ARGV: id, the block keys' prefix (block keys are named here: only SPOP knows which).
_FORGET_BLOCKS_LUA = """
redis.replicate_commands()
local hexes = redis.call('SPOP', KEYS[1], ARGV[3])
for _, hx in ipairs(hexes) do redis.call('SREM', ARGV[2] .. hx, ARGV[1]) end
return #hexes
"""
# Adds blocks ARGV[3..] (at most _BLOCKS_PER_STEP) to a worker's (KEYS[1]: wblocks:{id}); 1 if
# it did. With KEYS[2] (workers), only while the worker is registered there, else 0: a KV
# event's stored blocks. A worker purged as stale while alive would list them under an id no
# heartbeat names, and were it to die before its next beat (which registers it again and
# republishes), no purge would find them.
_ADD_BLOCKS_LUA = """
if KEYS[2] and redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 then return 0 end
for i = 3, #ARGV do redis.call('SADD', ARGV[2] .. ARGV[i], ARGV[1]) end
redis.call('SADD', KEYS[1], unpack(ARGV, 3))
return 1
"""
# Drops an entry that does not parse, if it still holds the bytes read: its worker may have
# written a good one since.
_DROP_BAD_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  return redis.call('HDEL', KEYS[1], ARGV[1])
end
return 0
"""

REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def check_redis_url(url) -> str:
    """A URL redis-py connects with; ValueError naming it otherwise. Parsed here, as services
    build their configuration: a port or database that does not parse failed once the model
    had loaded and the server listened. (A database past the server's count is the server's
    to say: router/redis_database.py.) Messages leave out the URL's password."""
    if not isinstance(url, str) or not url.startswith(REDIS_SCHEMES):
        raise ValueError(f"redis_url must be a redis:// URL, got {redacted(url)!r}")
    try:
        parts = parse_url(url)  # opens nothing
    except (ValueError, TypeError) as e:
        raise ValueError(f"redis_url {redacted(url)!r} does not parse: {e}") from None
    path = urlparse(url).path.strip("/") if not url.startswith("unix://") else ""
    if path and not (path.isascii() and path.isdigit()):  # redis-py would take database 0
        raise ValueError(f"redis_url {redacted(url)!r}: the database must be a number, got "
                         f"{path!r}")
    if not 0 <= parts.get("db", 0) < 1 << 16:
        raise ValueError(f"redis_url {redacted(url)!r}: database {parts['db']} is no database")
    return url


def check_namespace(namespace) -> str:
    """A namespace the key schema above can hold; ValueError naming --namespace otherwise.
    Routers and workers check theirs when their configuration is built: the Registry that
    also refuses one is made only once the model is loaded (minutes, for a large one)."""
    # Keys are "{ns}:part:...": with a ':' one namespace's keys could be another's (namespace
    # "a:wblocks"'s worker hash is namespace "a"'s block set of a worker named "workers").
    if not isinstance(namespace, str) or not namespace or ":" in namespace:
        raise ValueError(f"namespace (--namespace) must be non-empty without ':', "
                         f"got {namespace!r}")
    return namespace


# How stale a heartbeat the routers take for a worker gone (Registry.ttl_s's default).
ROUTER_TTL_S = 5.0


@dataclass(frozen=True)
class Heartbeat:
    # The worker was not registered: new, or dropped since its last beat (purged as stale,
    # or a new empty Redis), with its index entries and KV handles.
    dropped: bool
    drained: bool  # an admin drained it (as Redis has it after this beat)
    # It was registered again over a purge's tombstone: a purge of its id ended since its
    # last beat (or since a starting worker cleared its id), dropping its KV handles too.
    purged: bool = False


class Registry:
    def __init__(self, client: aioredis.Redis, namespace: str = "pdserve",
                 ttl_s: float = ROUTER_TTL_S) -> None:
        self.r = client
        self.ns = check_namespace(namespace)
        self.ttl_s = ttl_s
        self._match = client.register_script(_MATCH_LUA)
        self._beat = client.register_script(_HEARTBEAT_LUA)
        self._stale = client.register_script(_STALE_LUA)
        self._drain = client.register_script(_DRAIN_LUA)
        self._undrain = client.register_script(_UNDRAIN_LUA)
        self._purge_entries = client.register_script(_PURGE_LUA)
        self._forget_some = client.register_script(_FORGET_BLOCKS_LUA)
        self._add_some = client.register_script(_ADD_BLOCKS_LUA)
        self._drop_bad = client.register_script(_DROP_BAD_LUA)
        self.ledger = TransferLedger(self)

    @classmethod
    def from_url(cls, url: str, namespace: str = "pdserve", ttl_s: float = ROUTER_TTL_S,
                 on_database_missing: Callable[[str], None] | None = None) -> Registry:
        """``on_database_missing``: called once with the message if the server refuses the
        URL's database (router/redis_database.py), which the calls then fail with."""
        # socket_timeout None: redis-py's default (5 s) would await writes through
        # asyncio.wait_for; each call is bounded by router/redis_bound.py instead.
        watch = DatabaseWatch(url, on_database_missing)
        return cls(aioredis.from_url(url, socket_connect_timeout=REDIS_TIMEOUT_S,
                                     socket_timeout=None, redis_connect_func=watch.connect),
                   namespace, ttl_s)

    def _k(self, *parts: str) -> str:
        return ":".join((self.ns, *parts))

    # --- workers --------------------------------------------------------------------------
    @bounded
    async def heartbeat(self, info: common_pb2.WorkerInfo, ttl_s: float | None = None,
                        drained: bool = False) -> Heartbeat:
        """Registers or refreshes a worker (its load travels with the heartbeat). ``ttl_s``:
        how long the worker may stay silent before a reader takes it for gone (None: as long
        as each reader's own TTL). ``drained``: whether an admin had drained it, as the
        worker last knew: put back if Redis forgot it (a restart); after a purge, what Redis
        kept of the admin's decision wins (it may be newer)."""
        if info.role not in ROLES or not info.worker_id:
            raise ValueError(f"bad worker info: role {info.role!r}, id {info.worker_id!r}")
        if ttl_s is not None and not 0 < ttl_s < float("inf"):
            raise ValueError(f"a heartbeat's ttl_s must be positive seconds, got {ttl_s!r}")
        wid = info.worker_id
        added, is_drained, purged = await self._beat(
            keys=[self._k("workers"), self._k("heartbeats"), self._k("drained"),
                  self._k("ttls"), self._k("purged", wid), self._k("kvhandles", wid)],
            args=[wid, info.SerializeToString(), "" if ttl_s is None else repr(float(ttl_s)),
                  "1" if drained else "0", int(KV_HANDLES_TTL_S * 1000)])
        return Heartbeat(dropped=bool(added), drained=bool(is_drained), purged=bool(purged))

    @bounded
    async def deregister(self, worker_id: str, keep_transfers: bool = False) -> None:
        """Drops a worker's registration and index entries. ``keep_transfers``: not its
        transfer-ledger entries nor its KV handles (a worker leaving for a drain still holds
        those leases, which decode workers still read; it drops them once the drain ends,
        router/presence.py)."""
        await self._purge([worker_id], keep_transfers)

    @bounded
    async def live_workers(self, role: str | None = None,
                           purge: bool = True) -> list[common_pb2.WorkerInfo]:
        """The workers whose heartbeat is not stale. ``purge``: the stale ones' entries go
        first, here; without it they are only left out (a router purges them apart, in
        ``purge_stale``: with a big prefix cache that takes a while)."""
        stale = set()
        if purge:
            await self._purge_stale()
        else:
            stale = set(await self._stale(keys=[self._k("heartbeats"), self._k("ttls")],
                                          args=[self.ttl_s]))
        raw = await self.r.hgetall(self._k("workers"))
        # errors="replace": a member that is no id matches no worker, and must not raise.
        drained = {d.decode(errors="replace") for d in await self.r.smembers(self._k("drained"))}
        out = []
        for field, blob in sorted(raw.items()):
            if field in stale:
                continue
            info = _parse_info(field, blob)
            if info is None:
                await self._drop_unreadable_info(field, blob)
                continue
            info.draining = info.draining or info.worker_id in drained
            if role is None or info.role == role:
                out.append(info)
        return out

    @bounded
    async def purge_stale(self) -> None:
        """Drops the stale workers' registration and index entries. Each step is short, but a
        worker's blocks go a step of ``_BLOCKS_PER_STEP`` at a time: some 10^5 blocks take
        seconds. Cut short (the time bound), it goes on where it stopped at the next call:
        a worker's heartbeat entry goes last."""
        await self._purge_stale()

    async def _purge_stale(self) -> None:
        stale = await self._stale(keys=[self._k("heartbeats"), self._k("ttls")],
                                  args=[self.ttl_s])
        for member in stale:
            try:
                wid = member.decode()
            except UnicodeDecodeError:  # no worker's: ids are str
                await self._drop_unreadable_id(member)
                continue
            await self._purge([wid], stale_by=self.ttl_s)

    async def _drop_unreadable_info(self, field: bytes, blob: bytes) -> None:
        if await self._drop_bad(keys=[self._k("workers")], args=[field, blob]):
            logger.warning("dropped registry entry %r: not a WorkerInfo for that id (%d bytes)",
                           field, len(blob))

    async def _drop_unreadable_id(self, member: bytes) -> None:
        async with self.r.pipeline(transaction=True) as p:
            p.zrem(self._k("heartbeats"), member)
            p.hdel(self._k("workers"), member)
            p.hdel(self._k("ttls"), member)
            p.srem(self._k("drained"), member)
            await p.execute()
        logger.warning("dropped registry heartbeat %r: not a worker id (not UTF-8)", member)

    @bounded
    async def set_drained(self, worker_id: str, drained: bool) -> bool:
        """Whether it changed anything: a drain lands only on a registered worker; an undrain
        clears the flag of any id (also one whose worker is gone, or was purged and comes
        back)."""
        if drained:
            return bool(await self._drain(keys=[self._k("workers"), self._k("drained")],
                                          args=[worker_id]))
        return bool(await self._undrain(keys=[self._k("drained"),
                                              self._k("purged", worker_id)],
                                        args=[worker_id]))

    async def _purge(self, worker_ids: list[str], keep_transfers: bool = False,
                     stale_by: float | None = None) -> None:
        """``stale_by``: purged as stale by this TTL; the heartbeat entry stays if a beat
        came meanwhile (_PURGE_LUA). None: dropped regardless (a deregister)."""
        for wid in worker_ids:
            # Unregistered first: a live worker's stored blocks landing while its blocks are
            # forgotten (seconds, for a big cache) are refused from now, not left under an
            # id whose heartbeat entry the last step drops (found by no purge after). The
            # heartbeat entry goes last: a purge cut short is found stale again, and resumed.
            await self.r.hdel(self._k("workers"), wid)
            await self._forget_blocks(wid)
            if not keep_transfers:
                # A live worker purged as stale puts back those it still holds when it beats
                # again (its republish).
                await self.ledger.forget_worker(wid)
            # A worker leaving for a drain keeps its KV handles with its leases: the decode
            # workers' pulls the drain waits for read them (decode_svc/kv_sources.py refuses
            # a handle its worker has not registered). It drops them once the drain ends.
            await self._purge_entries(
                keys=[self._k("workers"), self._k("heartbeats"), self._k("drained"),
                      self._k("ttls"), self._k("kvhandles", wid), self._k("purged", wid)],
                args=[wid, int(_PURGED_TTL_S * 1000), "0" if keep_transfers else "1",
                      "" if stale_by is None else repr(float(stale_by))])

    # --- KV agents ------------------------------------------------------------------------
    @bounded
    async def set_kv_handles(self, worker_id: str, handles: list[bytes],
                             mac_key: bytes = b"") -> None:
        """A prefill worker's ranks' KV-agent handles (kvtransfer.KVAgentHandle bytes), so
        decode workers can connect before their first pull, and the key its KV handles are
        signed with (kvtransfer/handle_mac.py); gone when the worker is purged. The key is an
        entry of the same list: it has the handles' lifetime and purge by construction."""
        key = self._k("kvhandles", worker_id)
        async with self.r.pipeline(transaction=True) as p:
            p.delete(key)
            if handles:
                p.rpush(key, *handles, *([_MAC_KEY_TAG + mac_key] if mac_key else []))
                p.pexpire(key, int(KV_HANDLES_TTL_S * 1000))
            await p.execute()

    async def kv_handles(self, worker_id: str) -> list[bytes]:
        return (await self.kv_source(worker_id))[0]

    @bounded
    async def kv_source(self, worker_id: str) -> tuple[list[bytes], bytes]:
        """A prefill worker's rank handles and its KV handles' key (b"" if none), in one read."""
        entries = await self.r.lrange(self._k("kvhandles", worker_id), 0, -1)
        keys = [e[len(_MAC_KEY_TAG):] for e in entries if e.startswith(_MAC_KEY_TAG)]
        return [e for e in entries if not e.startswith(_MAC_KEY_TAG)], (keys or [b""])[-1]

    # --- prefix-block index ---------------------------------------------------------------
    @bounded
    async def publish_events(self, worker_id: str, events: list) -> bool:
        """Applies a worker's engine KV-cache events and its transfer-ledger events
        (router/ledger.py) in one pipeline, in order. False if stored blocks were dropped:
        the worker is not registered (purged, or Redis restarted), and must republish its
        blocks once its next beat registers it again."""
        if not events:
            return True
        wkey = self._k("wblocks", worker_id)
        stores = []  # where each stored-blocks step's answer is in the pipeline's
        # A transaction: a worker killed mid-send must not leave a block key naming it that
        # its wblocks set lacks (the block's SADD sent, the wblocks one not), orphaned for good.
        async with self.r.pipeline(transaction=True) as p:
            for ev in events:
                if isinstance(ev, BlockStored):
                    hexes = [h.hex() for h in ev.block_hashes]
                    for i in range(0, len(hexes), _BLOCKS_PER_STEP):
                        stores.append(len(p))
                        await self._add_some(
                            keys=[wkey, self._k("workers")], client=p,
                            args=[worker_id, self._k("block", ""),
                                  *hexes[i:i + _BLOCKS_PER_STEP]])
                elif isinstance(ev, BlockRemoved):
                    hexes = [h.hex() for h in ev.block_hashes]
                    for hx in hexes:
                        p.srem(self._k("block", hx), worker_id)
                    p.srem(wkey, *hexes)
                elif not self.ledger.queue(p, worker_id, ev):
                    raise TypeError(f"not a KV-cache or ledger event: {ev!r}")
            answers = await p.execute()
        return all(answers[i] for i in stores)

    @bounded
    async def set_worker_blocks(self, worker_id: str, block_hashes: list[bytes]) -> None:
        """Replaces what the index says ``worker_id`` holds with exactly ``block_hashes``. In
        steps: the worker publishes no KV event meanwhile (router/presence.py), or one landing
        between the forget and the add would be undone."""
        await self._forget_blocks(worker_id)
        hexes = [h.hex() for h in block_hashes]
        for i in range(0, len(hexes), _BLOCKS_PER_STEP):
            await self._add_some(keys=[self._k("wblocks", worker_id)],
                                 args=[worker_id, self._k("block", ""),
                                       *hexes[i:i + _BLOCKS_PER_STEP]])

    @bounded
    async def clear_worker(self, worker_id: str) -> None:
        """A worker (re)starting with an empty cache drops whatever it held before: its
        prefix-index entries, its transfer-ledger entries (their leases died with it), and an
        admin's drain of its predecessor under the id: a new worker does not start drained,
        whether or not a router purged the old one first."""
        await self._forget_blocks(worker_id)
        await self.ledger.forget_worker(worker_id)
        async with self.r.pipeline(transaction=True) as p:
            p.srem(self._k("drained"), worker_id)
            p.delete(self._k("purged", worker_id))
            await p.execute()

    async def _forget_blocks(self, worker_id: str) -> None:
        args = [worker_id, self._k("block", ""), _BLOCKS_PER_STEP]
        while await self._forget_some(keys=[self._k("wblocks", worker_id)],
                                      args=args) == _BLOCKS_PER_STEP:
            pass

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


def _parse_info(field: bytes, blob: bytes) -> common_pb2.WorkerInfo | None:
    """The WorkerInfo a ``{ns}:workers`` entry holds; None if it is none, or not the one its
    field names (a heartbeat writes both from one id)."""
    try:
        info = common_pb2.WorkerInfo.FromString(blob)
    except DecodeError:
        return None
    if info.role not in ROLES or info.worker_id.encode() != field:
        return None
    return info
