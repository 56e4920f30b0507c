"""The routers sharing a Redis namespace, and this router's place among them.

Each router counts only its own requests in flight, so routers idle at once all rank the
workers alike unless their ties go apart (router/routing_policy.py). A hash of the router's
id orders them independently, which still puts two routers on one of two workers half the
time; knowing that there are R routers and that this one is the i-th (by id) lets router i
start its tie order at worker i*W/R of the W tied ones: routers spread over the workers
whenever R <= W, and as evenly as can be when R > W.

Key (``ns`` is the registry's namespace): ``{ns}:routers`` ZSET router id -> Redis time of its
last beat. A router beats every second with the router heartbeat (router/router_presence.py);
one silent for ``TTL_S`` is dropped by the next beat of any router, so a killed router leaves
the count within seconds. Redis's clock alone stamps and judges the beats.
"""
from __future__ import annotations

from dataclasses import dataclass

from router.redis_bound import bounded

# KEYS: routers. ARGV: this router's id, the TTL in seconds. Returns the live ids.
_BEAT_LUA = """
redis.replicate_commands()
local t = redis.call('TIME')
local now = t[1] + t[2] / 1000000
redis.call('ZADD', KEYS[1], string.format('%.6f', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf',
           '(' .. string.format('%.6f', now - tonumber(ARGV[2])))
return redis.call('ZRANGE', KEYS[1], 0, -1)
"""


@dataclass(frozen=True)
class RouterPlace:
    """This router's index among ``count`` live routers, ordered by id."""

    index: int
    count: int

    def offset(self, num_workers: int) -> int:
        """Where among ``num_workers`` tied workers (by id) this router's order starts."""
        return self.index * num_workers // self.count


class RouterPeers:
    def __init__(self, r, namespace: str, router_id: str, ttl_s: float) -> None:
        self.r = r
        self.key = f"{namespace}:routers"
        self.router_id = router_id
        self.ttl_s = ttl_s
        self._beat = r.register_script(_BEAT_LUA)
        # None until a beat went through (Redis away at start): ties then go by the hash.
        self.place: RouterPlace | None = None

    @bounded
    async def beat(self) -> RouterPlace:
        ids = sorted(i.decode(errors="replace")
                     for i in await self._beat(keys=[self.key],
                                               args=[self.router_id, self.ttl_s]))
        self.place = RouterPlace(ids.index(self.router_id), len(ids))
        return self.place

    @bounded
    async def leave(self) -> None:
        await self.r.zrem(self.key, self.router_id)
