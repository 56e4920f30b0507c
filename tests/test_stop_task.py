"""Tasks looping on Redis calls stop when told (client/tasks.py): a plain cancel is lost often
enough on Python 3.11 (asyncio.wait_for inside redis-py, with a socket_timeout) that a router's
stop once hung for good. The Registry now bounds its calls itself, and its cancels land; the
loops keep their stop flags and stop_task for any other call that swallows one. Real Redis."""
from __future__ import annotations

import asyncio
import random
import sys
import time

import pytest
import redis.asyncio as aioredis

from client.tasks import stop_task
from router.directory import WorkerDirectory
from router.presence import WorkerPresence
from router.registry import Registry
from protos import common_pb2


async def _redis_loop(call, stopping: list[bool]) -> None:
    while not stopping:
        await call()


async def _lost_cancels(call, tries: int = 20) -> int:
    """How many of ``tries`` plain cancels of a loop of ``call()`` did not end it; each loop is
    then stopped the sure way (its flag and stop_task), which must always work."""
    lost = 0
    for _ in range(tries):
        stopping: list[bool] = []
        task = asyncio.ensure_future(_redis_loop(call, stopping))
        await asyncio.sleep(random.uniform(0, 0.003))
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=0.2)
        lost += not done
        stopping.append(True)
        assert await stop_task(task, timeout_s=5.0)
    return lost


def test_a_plain_cancel_of_registry_calls_always_lands(redis_url):
    async def body():
        registry = Registry.from_url(redis_url, "stop")
        try:
            return await _lost_cancels(registry.live_workers, tries=50)
        finally:
            await registry.r.aclose()

    assert asyncio.run(body()) == 0


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="CPython gh-86296 is fixed in 3.12")
def test_premise_redis_py_with_a_socket_timeout_loses_cancels_on_python_3_11(redis_url):
    """Why the Registry bounds its own calls: if this ever passes no more, the premise is gone."""
    async def body():
        client = aioredis.from_url(redis_url, socket_timeout=5.0)
        try:
            return await _lost_cancels(lambda: client.hgetall("stop:workers"))
        finally:
            await client.aclose()

    assert asyncio.run(body()) > 0


def test_a_directory_and_a_presence_stop_while_their_loops_talk_to_redis(redis_url):
    async def body():
        for i in range(15):
            d = WorkerDirectory(Registry.from_url(redis_url, "stop-dir"), 16,
                                refresh_interval_s=0.001)
            await d.start()
            info = common_pb2.WorkerInfo(worker_id=f"p{i}", role="prefill", address="x:1")
            p = WorkerPresence(redis_url, "stop-dir", 0.001, lambda info=info: info)
            await p.start()
            await asyncio.sleep(random.uniform(0.01, 0.05))
            t = time.monotonic()
            await asyncio.wait_for(asyncio.gather(d.stop(), p.stop()), 20)
            assert time.monotonic() - t < 10

    asyncio.run(body())


def test_a_task_that_will_not_stop_is_given_up_on():
    async def stubborn():
        while True:
            try:
                await asyncio.sleep(1)
            except asyncio.CancelledError:
                pass

    async def body():
        task = asyncio.ensure_future(stubborn())
        await asyncio.sleep(0)
        assert not await stop_task(task, timeout_s=0.6)
        assert not task.done()
        task.get_coro().close()  # no warning about a pending task at exit

    asyncio.run(body())
