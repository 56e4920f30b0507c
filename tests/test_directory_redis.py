"""The router's routing view through Redis trouble, against a real redis-server: a hung Redis
(SIGSTOP) costs only the first routing decisions a short wait, a Redis restarted empty refuses
no request, a registry that cannot be read does not stop the router from starting, and workers
of another model sharing the namespace get no requests."""
from __future__ import annotations

import asyncio
import functools
import logging
import os
import signal
import time

import grpc
import pytest

from engine.block_hash import hash_request_tokens
from protos import common_pb2
from router.directory import NoWorkerError, WorkerDirectory
from router.presence import WorkerPresence
from router.redis_health import RedisHealth
from router.redis_server import RedisServer
from router.registry import Registry
from tests.serving_helpers import heartbeat_info


# Every worker here says one model's context length, as a cluster's do.
_info = functools.partial(heartbeat_info, max_model_len=2048)


async def _register(url: str, ns: str, *infos: common_pb2.WorkerInfo) -> None:
    writer = Registry.from_url(url, ns)
    try:
        for info in infos:
            await writer.heartbeat(info)
    finally:
        await writer.r.aclose()


async def _routing_times(d: WorkerDirectory, n: int, every_s: float) -> list[float]:
    """How long each of ``n`` prefill routing decisions (a prefix lookup each), started
    ``every_s`` apart, took."""
    hashes = hash_request_tokens(list(range(64)), 16)

    async def one() -> float:
        t = time.monotonic()
        await d.pick_prefill(hashes, 64)
        return time.monotonic() - t

    tasks = []
    for _ in range(n):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(every_s)
    return await asyncio.gather(*tasks)


def test_a_hung_redis_delays_only_the_first_routing_decisions():
    """While Redis hangs, requests route on the last view at once: only those that came before
    any Redis call had waited REDIS_SLOW_S wait, and none the registry's own 5 s bound (which
    the periodic refresh keeps running into)."""
    async def body(server: RedisServer) -> list[float]:
        await _register(server.url, "hung", _info("p1", "prefill"), _info("d1", "decode"))
        d = WorkerDirectory(Registry.from_url(server.url, "hung", ttl_s=3600), 16,
                            refresh_interval_s=0.5)
        await d.start()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            times = await _routing_times(d, 20, 0.4)  # 8 s: the refresh fails, and retries
            assert not d.registry_ok
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        await d.stop()
        return times

    with RedisServer() as server:
        times = asyncio.run(body(server))
    # Bounds that detect waiting out the registry's timeout, not timings: without the
    # short bound every decision of the first 5 s (and more later) took 5 s.
    assert max(times) < 4.5, times
    assert sum(t < 1.5 for t in times) >= 15, times


def test_a_long_purge_of_a_dead_worker_leaves_prefix_routing_on(redis_url):
    """Purging a dead worker with a big prefix cache takes seconds, Redis answering each step:
    no hang. It was part of the refresh, so Redis was taken for hung, prefix lookups skipped
    (no hits), and the view took in no new worker until it ended."""
    async def body():
        hashes = hash_request_tokens(list(range(64)), 16)
        writer = Registry.from_url(redis_url, "slowpurge")
        for wid in ("live", "dead"):
            await writer.heartbeat(_info(wid, "prefill"))
            await writer.set_worker_blocks(wid, hashes)
        beating = {"live"}  # "dead" beats no more, and is stale a second on

        async def beat() -> None:
            while True:
                for wid in beating:
                    await writer.heartbeat(_info(wid, "prefill"))
                await asyncio.sleep(0.2)

        beats = asyncio.create_task(beat())
        reg = Registry.from_url(redis_url, "slowpurge", ttl_s=1.0)
        forget, purged = reg._forget_blocks, asyncio.Event()

        async def long_forget(wid: str) -> None:  # a big cache's many steps
            await purged.wait()
            await forget(wid)

        reg._forget_blocks = long_forget
        d = WorkerDirectory(reg, 16, refresh_interval_s=0.1)
        await d.start()
        try:
            for _ in range(50):  # 2.5 s: past its TTL, then past REDIS_SLOW_S
                assert (await d.pick_prefill(hashes, 64))[1] == 64 and d.registry_ok
                await asyncio.sleep(0.05)
            beating.add("new")
            while sorted(d.workers) != ["live", "new"]:
                await asyncio.sleep(0.05)
            assert await writer.r.scard("slowpurge:wblocks:dead") == 4  # still purging
            purged.set()
            while await writer.r.zscore("slowpurge:heartbeats", "dead") is not None:
                await asyncio.sleep(0.05)
            assert await writer.r.scard("slowpurge:wblocks:dead") == 0
            assert await d.registry.match_prefix(hashes, ["dead"]) == {"dead": 0}
        finally:
            purged.set()
            beats.cancel()
            await d.stop()
            await writer.r.aclose()

    asyncio.run(asyncio.wait_for(body(), 60))


def test_a_request_waits_on_redis_from_its_own_start(monkeypatch):
    """A request's Redis call is given up REDIS_SLOW_S after it began, not after the oldest
    call in flight began: one arriving late in a slow but answered call's wait was given up
    at once, and routed without prefix hits."""
    import router.redis_health
    # 1.5 s of slack either way: a loaded machine's loop stalls must not decide it.
    monkeypatch.setattr(router.redis_health, "REDIS_SLOW_S", 4.0)

    async def body():
        health, answer = RedisHealth(), asyncio.Event()
        slow = asyncio.create_task(health.run("a slow call", answer.wait))
        await asyncio.sleep(2.5)
        assert health.ok

        async def lookup() -> str:  # ends at 5 s: past the slow call's 4, within its own
            await asyncio.sleep(2.5)
            return "hits"

        got = await health.ask("a lookup", lookup, "none")
        answer.set()
        await slow
        return got

    assert asyncio.run(body()) == "hits"


def test_a_redis_restarted_empty_refuses_no_request_and_a_worker_that_leaves_goes():
    """The workers kept through the restart are the ones not registered again yet: one that
    leaves the new Redis goes at once, well within the TTL the others were kept for."""
    async def body(server: RedisServer) -> RedisServer:
        presences = [WorkerPresence(server.url, "restart", 1.0, lambda i=_info(w, r): i)
                     for w, r in (("p1", "prefill"), ("d1", "decode"), ("d2", "decode"))]
        for p in presences:
            await p.start()
        d = WorkerDirectory(Registry.from_url(server.url, "restart", ttl_s=6.0), 16,
                            refresh_interval_s=0.1)
        await d.start()
        try:
            assert sorted(d.workers) == ["d1", "d2", "p1"]
            port = server.port
            server.stop()
            server = RedisServer(port=port)  # a new Redis, empty (no persistence)
            deadline = time.monotonic() + 3.0  # past each worker's next heartbeats
            while time.monotonic() < deadline:
                await d.pick_prefill([], 10)  # NoWorkerError fails the test
                await d.pick_decode(10)
                await asyncio.sleep(0.05)
            assert sorted(d.workers) == ["d1", "d2", "p1"]
            await presences.pop().stop()  # d2 leaves the new Redis, younger than the TTL
            for _ in range(20):  # 1 s: waiting out the TTL would take 2 s more at least
                await asyncio.sleep(0.05)
                if "d2" not in d.workers:
                    break
            assert sorted(d.workers) == ["d1", "p1"]
        finally:
            await d.stop()
            for p in presences:
                await p.stop()
        return server

    server = RedisServer()
    try:
        server = asyncio.run(body(server))
    finally:
        server.stop()


def test_a_registry_that_cannot_be_read_does_not_stop_the_router_starting(redis_url, caplog):
    async def body():
        writer = Registry.from_url(redis_url, "broken")
        # Not a hash: every registry listing fails (WRONGTYPE), as an unreadable entry did.
        await writer.r.set("broken:workers", b"\xff\xff\xff")
        d = WorkerDirectory(Registry.from_url(redis_url, "broken"), 16, refresh_interval_s=0.1)
        try:
            with caplog.at_level(logging.WARNING, logger="router.directory"):
                await d.start()
            assert d.workers == {} and not d.registry_ok
            assert "the registry read at start failed" in caplog.text
            with pytest.raises(NoWorkerError) as err:
                await d.pick_prefill([], 10)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            # Once the registry reads again, the refresh loop fills the view.
            await writer.r.delete("broken:workers")
            await writer.heartbeat(_info("p1", "prefill"))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if d.workers:
                    break
            assert (await d.pick_prefill([], 10))[0].worker_id == "p1"
        finally:
            await d.stop()
            await writer.r.aclose()

    asyncio.run(body())


def test_workers_of_another_model_get_no_requests(redis_url, caplog):
    """Two clusters sharing a namespace: each router routes to its own model's workers only,
    the same model named by another path (another host's mount) included."""
    async def body():
        await _register(redis_url, "mix",
                        _info("p-other", "prefill", model="model-B"),
                        _info("d-other", "decode", model="/models/model-B"),
                        _info("p-ours", "prefill", model="/mnt/elsewhere/Model-A/"),
                        _info("d-ours", "decode", model="model-a"))
        d = WorkerDirectory(Registry.from_url(redis_url, "mix"), 16, refresh_interval_s=3600,
                            model="/models/model-A")
        try:
            with caplog.at_level(logging.WARNING, logger="router.directory"):
                await d.start()
                for _ in range(3):
                    await d.refresh()
            assert sorted(d.workers) == ["d-ours", "p-ours"]
            assert (await d.pick_prefill([], 10))[0].worker_id == "p-ours"
            assert (await d.pick_decode(10)).worker_id == "d-ours"
            foreign = [r for r in caplog.records if "serves model" in r.getMessage()]
            assert sorted(r.args[0] for r in foreign) == ["d-other", "p-other"]  # once each
        finally:
            await d.stop()

    asyncio.run(body())


def test_workers_are_told_apart_by_their_models_content(redis_url, caplog):
    """One model under another name serves; another model's weights under the router's name
    (replaced in place, or another cluster's mount at the same path) get no requests."""
    async def body():
        await _register(redis_url, "content",
                        *(_info(wid, role, model=model, model_fingerprint=fingerprint)
                          for wid, role, model, fingerprint in [
                              ("p-copy", "prefill", "/copies/renamed", "f1:w1"),
                              ("d-ours", "decode", "model-a", "f1:w1"),
                              ("p-retrained", "prefill", "model-a", "f1:w2"),
                              ("d-retokenized", "decode", "model-a", "f2:w1")]))
        d = WorkerDirectory(Registry.from_url(redis_url, "content"), 16,
                            refresh_interval_s=3600, model="model-a", model_fingerprint="f1:w1")
        try:
            with caplog.at_level(logging.WARNING, logger="router.directory"):
                await d.start()
                await d.refresh()
            assert sorted(d.workers) == ["d-ours", "p-copy"]
            foreign = {r.args[0]: r.args[4] for r in caplog.records
                       if "serves model" in r.getMessage()}
            assert sorted(foreign) == ["d-retokenized", "p-retrained"]
            assert "weights differ" in foreign["p-retrained"]
            assert "tokenizer files differ" in foreign["d-retokenized"]
        finally:
            await d.stop()
        # A router of a third model finds none of its own: its refusal says why.
        d = WorkerDirectory(Registry.from_url(redis_url, "content"), 16,
                            refresh_interval_s=3600, model="model-a", model_fingerprint="f3:w3")
        try:
            await d.start()
            assert not d.workers
            with pytest.raises(NoWorkerError, match=r"no prefill worker is available \(2 "
                               r"registered prefill workers serve another model"):
                await d.pick_prefill([], 10)
            with pytest.raises(NoWorkerError, match="2 registered decode workers serve another"):
                await d.pick_decode(10)
        finally:
            await d.stop()

    asyncio.run(body())
