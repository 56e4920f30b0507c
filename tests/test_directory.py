"""The router's routing view against a real redis-server: a worker that registered since the
last periodic refresh takes requests at once, and concurrent refreshes agree."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from engine.block_hash import hash_request_tokens
from protos import common_pb2
from router.directory import NoWorkerError, WorkerDirectory
from router.redis_server import RedisServer
from router.registry import Registry


@pytest.fixture(scope="module")
def redis_url():
    with RedisServer() as server:
        yield server.url


def _info(wid: str, role: str) -> common_pb2.WorkerInfo:
    return common_pb2.WorkerInfo(worker_id=wid, role=role, address="127.0.0.1:1", block_size=16,
                                 num_free_blocks=100)


def test_a_worker_registered_since_the_last_refresh_is_routed_to(redis_url):
    async def body():
        # A refresh interval far longer than the test: only the miss path can see the workers.
        d = WorkerDirectory(Registry.from_url(redis_url, "dir1"), 16, refresh_interval_s=3600)
        await d.start()
        try:
            with pytest.raises(NoWorkerError) as err:
                await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            writer = Registry.from_url(redis_url, "dir1")
            await writer.heartbeat(_info("p1", "prefill"))
            await writer.heartbeat(_info("d1", "decode"))
            await writer.r.aclose()
            worker, cached = await d.pick_prefill(hash_request_tokens(list(range(32)), 16), 32)
            assert (worker.worker_id, cached) == ("p1", 0)
            assert (await d.pick_decode(33)).worker_id == "d1"
            # Many requests missing at once refresh one at a time and agree on the view.
            await asyncio.gather(*(d.refresh() for _ in range(8)))
            assert sorted(d.workers) == ["d1", "p1"]
        finally:
            await d.stop()

    asyncio.run(body())
