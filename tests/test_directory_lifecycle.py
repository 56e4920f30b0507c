"""The router's worker handles through their lives, against a real redis-server: a dropped
worker's channel stays open while a request uses it, closes after, and all close at stop; a
burst of requests missing a worker shares registry reads; marks and warnings stay bounded."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc
import pytest
from grpc import ChannelConnectivity

from client.liveness import WatchedCalls, check_loop
from router import directory
from router.directory import NoWorkerError, WorkerDirectory
from router.registry import Registry
from tests.serving_helpers import heartbeat_info


@pytest.fixture(scope="module")
def redis_url(redis_url):
    # Past a new Redis's first second: the view (TTL below) then takes a worker missing
    # from it for gone, not for one that has not beaten since a restart.
    time.sleep(1.1)
    return redis_url


async def _view(redis_url: str, ns: str, *infos, registry=None) -> tuple:
    writer = Registry.from_url(redis_url, ns)
    for info in infos:
        await writer.heartbeat(info)
    d = WorkerDirectory(registry or Registry.from_url(redis_url, ns, ttl_s=0.5), 16,
                        refresh_interval_s=3600)
    await d.start()
    return d, writer


def _shut(handle) -> bool:
    return handle.channel.get_state() == ChannelConnectivity.SHUTDOWN


async def _until(pred, limit_s: float = 5.0) -> bool:
    for _ in range(int(limit_s / 0.01)):
        if pred():
            return True
        await asyncio.sleep(0.01)
    return pred()


def test_a_dropped_worker_keeps_its_channel_while_a_request_uses_it(redis_url, monkeypatch):
    # Between a request's prefill answer and its decode leg nothing watches the prefill
    # worker: its channel closed under the request, and the lease release or a migration's
    # probe of it then raised grpc's UsageError (INTERNAL) instead of reaching it or failing.
    monkeypatch.setattr(directory, "RETIRE_AFTER_S", 0.05)

    async def body():
        d, writer = await _view(redis_url, "life1", heartbeat_info("p1", "prefill"))
        try:
            p1 = d.workers["p1"]
            with d.in_use(p1):
                with d.inflight(p1):
                    pass  # the Prefill call answered
                await writer.deregister("p1")
                await d.refresh()
                assert "p1" not in d.workers
                await asyncio.sleep(0.3)  # the decode leg waits for room, past the retire delay
                assert not _shut(p1)
                assert await d.probe(p1) is False  # nothing listens at its address
            assert await _until(lambda: _shut(p1))
            # A probe of a handle whose channel is gone answers, rather than raising.
            assert await d.probe(p1) is False
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())


class _ClosedPeer:
    def __init__(self, channel) -> None:
        self.channel = channel
        self.calls = WatchedCalls()


def test_the_health_checks_go_on_past_a_peer_whose_channel_closed():
    async def body():
        channel = grpc.aio.insecure_channel("127.0.0.1:1")
        await channel.close()
        rounds = []

        def busy():
            rounds.append(1)
            return [_ClosedPeer(channel)]

        task = asyncio.create_task(check_loop(0.01, 2, busy, lambda p, r: None))
        await asyncio.sleep(0.3)
        assert not task.done(), task.exception()
        assert len(rounds) > 3
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())


def test_stop_closes_every_channel_the_directory_opened(redis_url):
    async def body():
        d, writer = await _view(redis_url, "life2", heartbeat_info("p1", "prefill"),
                                heartbeat_info("d1", "decode"), heartbeat_info("d2", "decode"))
        try:
            p1, d1, d2 = (d.workers[w] for w in ("p1", "d1", "d2"))
            await writer.deregister("d1")
            await writer.deregister("p1")
            with d.in_use(p1):  # dropped while a request uses it
                await d.refresh()
            await d.stop()  # d1 waits out its retire delay, p1 too
            assert _shut(p1) and _shut(d1) and _shut(d2)
        finally:
            await writer.r.aclose()

    asyncio.run(body())


class _CountingRegistry(Registry):
    reads = 0

    async def live_workers(self, role=None, purge=True):
        type(self).reads += 1
        await asyncio.sleep(0.002)  # a Redis a round trip away
        return await super().live_workers(role, purge)


def test_a_burst_of_requests_missing_a_worker_shares_the_registry_reads(redis_url):
    # A cluster without prefill workers: every request misses one and re-reads the registry.
    # Queued one by one, a burst's reads outlasted the Redis time limit and a healthy Redis
    # was taken for a failing one.
    async def body():
        d, writer = await _view(redis_url, "life3", heartbeat_info("d1", "decode"),
                                registry=_CountingRegistry.from_url(redis_url, "life3", ttl_s=0.5))
        try:
            _CountingRegistry.reads = 0

            async def one() -> None:
                with pytest.raises(NoWorkerError):
                    await d.pick_prefill([], 10)

            await asyncio.gather(*(one() for _ in range(500)))
            assert 1 <= _CountingRegistry.reads <= 3
            assert d.registry_ok
            # A worker registered before a request misses is still seen by it.
            await writer.heartbeat(heartbeat_info("p1", "prefill"))
            worker, _ = await d.pick_prefill([], 10)
            assert worker.worker_id == "p1"
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())


def test_marks_of_workers_gone_for_good_are_dropped(redis_url):
    async def body():
        d, writer = await _view(redis_url, "life4",
                                *(heartbeat_info(f"d{i}", "decode") for i in range(20)))
        try:
            for w in list(d.workers.values()):
                assert await d.probe(w) is False  # nothing listens: marked down
            assert len(d._down) == 20
            for i in range(20):
                await writer.deregister(f"d{i}")
            await d.refresh()
            assert d.workers == {} and d._down == {}
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())


def test_a_worker_of_another_block_size_is_logged_once(redis_url, caplog):
    async def body():
        d, writer = await _view(redis_url, "life5", heartbeat_info("p32", "prefill", block_size=32))
        try:
            with caplog.at_level(logging.WARNING, logger="router.directory"):
                for _ in range(3):
                    with pytest.raises(NoWorkerError):
                        await d.pick_prefill([], 10)
        finally:
            await writer.r.aclose()
            await d.stop()

    asyncio.run(body())
    said = [r.getMessage() for r in caplog.records if "--block-size 32" in r.getMessage()]
    assert len(said) == 1 and "p32" in said[0] and "16" in said[0]


def test_a_refusal_for_want_of_workers_names_their_other_block_size(redis_url):
    """Clients got a bare "no prefill worker is available" while the workers were registered
    and up; only the router's log said why."""
    async def body():
        d, writer = await _view(redis_url, "life7", heartbeat_info("p32", "prefill", block_size=32),
                                heartbeat_info("d32", "decode", block_size=32),
                                heartbeat_info("d64", "decode", block_size=64))
        try:
            with pytest.raises(NoWorkerError) as prefill:
                await d.pick_prefill([], 10)
            with pytest.raises(NoWorkerError) as decode:
                await d.pick_decode(10)
            return str(prefill.value), str(decode.value)
        finally:
            await writer.r.aclose()
            await d.stop()

    assert asyncio.run(body()) == (
        "no prefill worker is available (1 registered prefill worker has --block-size 32, not "
        "this router's 16)",
        "no decode worker is available (2 registered decode workers have --block-size 32, 64, "
        "not this router's 16)")


def test_block_size_notes_of_workers_gone_for_good_are_dropped(redis_url):
    """A misconfigured worker crash-looping under a new id each time (a pid in the default
    id) left one note per restart for the router's life."""
    async def body():
        restarts = (heartbeat_info(f"p{i}", "prefill", block_size=32) for i in range(20))
        d, writer = await _view(redis_url, "life6", *restarts)
        try:
            with pytest.raises(NoWorkerError):
                await d.pick_prefill([], 10)
            assert len(d._other_block_size) == 20
            for i in range(20):
                await writer.deregister(f"p{i}")
            await d.refresh()
            return d._other_block_size
        finally:
            await writer.r.aclose()
            await d.stop()

    assert asyncio.run(body()) == set()
