"""Routers sharing a Redis namespace and its workers spread their tied picks by their place
among each other (router/router_peers.py), against a real redis-server."""
from __future__ import annotations

import asyncio
from collections import Counter

from engine.block_hash import hash_request_tokens
from router.directory import WorkerDirectory
from router.registry import Registry
from router.router_peers import RouterPeers, RouterPlace
from router.router_presence import TTL_S
from tests.serving_helpers import heartbeat_info

PROMPT = list(range(32))


async def _first_picks(url: str, ns: str, router_ids: list[str]) -> tuple[Counter, Counter]:
    """Each router's first prefill and decode pick over idle workers, its place known."""
    peers = [RouterPeers(Registry.from_url(url, ns).r, ns, rid, TTL_S) for rid in router_ids]
    for p in peers:
        await p.beat()
    for p in peers:  # every router's place once all have beaten
        await p.beat()
    routers = [WorkerDirectory(Registry.from_url(url, ns), 16, refresh_interval_s=3600,
                               tie_seed=p.router_id, router_place=lambda p=p: p.place)
               for p in peers]
    prefills, decodes = Counter(), Counter()
    try:
        for d in routers:
            await d.refresh()
            worker, _ = await d.pick_prefill(hash_request_tokens(PROMPT, 16), len(PROMPT))
            prefills[worker.worker_id] += 1
            decodes[(await d.pick_decode(33)).worker_id] += 1
    finally:
        for d in routers:
            await d.stop()
        for p in peers:
            await p.r.aclose()
    return prefills, decodes


async def _hash_first(url: str, ns: str, router_id: str) -> str:
    """The prefill worker a router takes first by the hash of its id alone."""
    d = WorkerDirectory(Registry.from_url(url, ns), 16, tie_seed=router_id)
    try:
        await d.refresh()
        ranks = d.tie_ranks(d.candidates("prefill"))
        return min(ranks, key=ranks.get)
    finally:
        await d.stop()


def test_routers_idle_at_once_send_their_first_requests_to_different_workers(redis_url):
    """"router-0" and "router-3" order p1 before p2 by the hash of their ids (the order a
    router falls back on while it does not know its place): their places among the routers
    send them to different workers all the same, and three routers over two workers put two
    on one and one on the other."""
    async def body():
        for ns in ("peers1", "peers2"):
            writer = Registry.from_url(redis_url, ns)
            for wid, role in (("p1", "prefill"), ("p2", "prefill"), ("d1", "decode"),
                              ("d2", "decode")):
                await writer.heartbeat(heartbeat_info(wid, role))
            await writer.r.aclose()
        assert [await _hash_first(redis_url, "peers1", rid) for rid in ("router-0", "router-3")] \
            == ["p1", "p1"]  # the case this test is about: both on p1 by the hash
        prefills, decodes = await _first_picks(redis_url, "peers1", ["router-0", "router-3"])
        assert prefills == {"p1": 1, "p2": 1} and decodes == {"d1": 1, "d2": 1}
        prefills, decodes = await _first_picks(redis_url, "peers2", ["a", "b", "c"])
        assert sorted(prefills.values()) == [1, 2] and sorted(decodes.values()) == [1, 2]

    asyncio.run(body())


def test_a_router_that_left_or_went_silent_no_longer_counts(redis_url):
    async def body():
        r = Registry.from_url(redis_url, "peers3").r
        a, b = (RouterPeers(r, "peers3", rid, TTL_S) for rid in ("a", "b"))
        await a.beat()
        assert await b.beat() == RouterPlace(1, 2)
        await a.leave()
        assert await b.beat() == RouterPlace(0, 1)
        # A router killed stops beating: its last beat, older than the TTL, is dropped by
        # the next beat of any other.
        await r.zadd("peers3:routers", {"dead": 1.0})
        assert await b.beat() == RouterPlace(0, 1)
        assert await r.zrange("peers3:routers", 0, -1) == [b"b"]
        assert RouterPlace(2, 3).offset(2) == 1 and RouterPlace(1, 3).offset(2) == 0
        await r.aclose()

    asyncio.run(body())
