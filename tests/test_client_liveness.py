"""The SDK's health checks of its routers (client/liveness.py): a router that hangs under a call
(here a real gRPC server on loopback whose calls and health checks never answer) has the call
cut, and the request fails over to the next router, for both clients and both calls. The
cluster test of the same, with a SIGSTOPped real router, is in test_client_failover.py."""
from __future__ import annotations

import asyncio
import threading
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client import AsyncClient, Client, FailoverPolicy
from protos import router_pb2, router_pb2_grpc

POLICY = FailoverPolicy(health_check_interval_s=0.1, health_check_misses=3, backoff_s=0.0)


class _Router(router_pb2_grpc.RouterServicer, health_pb2_grpc.HealthServicer):
    """``hung``: streams one token, then neither its calls nor its health checks answer.
    Otherwise: streams the rest of the output (tokens 8, 9) after what the client resumes."""

    def __init__(self, hung: bool) -> None:
        self.hung = hung
        self.release = threading.Event()  # lets blocked handlers go at the end
        self.resumed: list[list[int]] = []

    def Check(self, request, context):
        if self.hung:
            self.release.wait()
        return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.SERVING)

    def Generate(self, request, context):
        if self.hung:
            yield router_pb2.GenerateChunk(request_id="r", token_ids=[7])
            self.release.wait()
            return
        self.resumed.append(list(request.resume_token_ids))
        yield router_pb2.GenerateChunk(request_id="r", token_ids=[8, 9], finish_reason="length",
                                       usage=router_pb2.Usage(completion_tokens=3))

    def Complete(self, request, context):
        if self.hung:
            self.release.wait()
        self.resumed.append(list(request.resume_token_ids))
        return router_pb2.CompleteResponse(request_id="r", token_ids=[8, 9],
                                           finish_reason="length",
                                           usage=router_pb2.Usage(completion_tokens=2))


@pytest.fixture()
def routers():
    servers, routers = [], []
    for hung in (True, False):
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        r = _Router(hung)
        router_pb2_grpc.add_RouterServicer_to_server(r, server)
        health_pb2_grpc.add_HealthServicer_to_server(r, server)
        r.address = f"127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
        server.start()
        servers.append(server)
        routers.append(r)
    yield routers
    for r, server in zip(routers, servers):
        r.release.set()
        server.stop(0)


def _check(routers, streamed, done, again) -> None:
    hung, ok = routers
    # Round robin: the stream and the third call start on the hung router, the second on the
    # other; the stream resumes from the token the hung router sent.
    assert [t for c in streamed for t in c.token_ids] == [7, 8, 9]
    assert streamed[-1].usage.migrations == 1
    assert done.token_ids == [8, 9] and done.usage.migrations == 0
    assert again.token_ids == [8, 9] and again.usage.migrations == 1
    assert ok.resumed == [[7], [], []]


def test_the_blocking_client_cuts_a_hung_router_and_fails_over(routers):
    with Client([r.address for r in routers], timeout=60, failover=POLICY) as c:
        streamed = list(c.generate([1, 2, 3], max_tokens=3))
        done = c.complete([1, 2, 3], max_tokens=2)
        again = c.complete([1, 2, 3], max_tokens=2)
    _check(routers, streamed, done, again)


def test_the_asyncio_client_cuts_a_hung_router_and_fails_over(routers):
    async def run():
        async with AsyncClient([r.address for r in routers], timeout=60, failover=POLICY) as c:
            streamed = [chunk async for chunk in c.generate([1, 2, 3], max_tokens=3)]
            done = await c.complete([1, 2, 3], max_tokens=2)
            again = await c.complete([1, 2, 3], max_tokens=2)
        return streamed, done, again

    _check(routers, *asyncio.run(run()))


def test_closing_the_asyncio_client_fails_the_calls_of_other_tasks_with_its_own_error(routers):
    """Closing the channels cancels their calls: a task that did not cancel itself gets the
    SDK's CancelledError, as the blocking client's callers do, while a task its owner cancels
    stays cancelled."""
    from client import CancelledError

    hung = routers[0].address
    off = FailoverPolicy(health_check_interval_s=0, keepalive_time_s=None)

    async def run():
        c = AsyncClient(hung, timeout=60, failover=off)

        async def stream():
            return [chunk async for chunk in c.generate([1, 2, 3], max_tokens=3)]

        tasks = [asyncio.create_task(stream()),
                 asyncio.create_task(c.complete([1, 2, 3], max_tokens=2)),
                 asyncio.create_task(stream())]
        await asyncio.sleep(0.5)  # every call is on the router, which holds them
        tasks[2].cancel()
        await c.close()
        return await asyncio.gather(*tasks, return_exceptions=True), tasks

    results, tasks = asyncio.run(run())
    assert [type(r) for r in results[:2]] == [CancelledError, CancelledError]
    assert not tasks[0].cancelled() and not tasks[1].cancelled() and tasks[2].cancelled()


def test_an_asyncio_client_built_outside_a_loop_serves_the_loop_of_its_first_call(routers):
    c = AsyncClient(routers[1].address, timeout=60, failover=POLICY)  # no loop runs yet

    async def ask():
        return (await c.complete([1, 2, 3], max_tokens=2)).token_ids

    async def ask_then_close():
        try:
            return await ask()
        finally:
            await c.close()

    assert asyncio.run(ask_then_close()) == [8, 9]
    with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
        asyncio.run(ask())
    c = AsyncClient(routers[1].address, timeout=60, failover=POLICY)  # left open this time
    assert asyncio.run(ask()) == [8, 9]
    with pytest.raises(RuntimeError, match="a client per event loop"):
        asyncio.run(ask())  # its channels are the first loop's, which has ended


def test_a_blocking_client_dropped_without_close_leaves_no_thread_behind(routers):
    import gc

    from tests.proc_signals import wait_until

    def checkers() -> int:
        return sum(t.name == "pdserve-health-checks" for t in threading.enumerate())

    before = checkers()
    for _ in range(3):
        c = Client(routers[1].address, timeout=60, failover=POLICY)
        assert c.complete([1, 2, 3], max_tokens=2).token_ids == [8, 9]
    assert checkers() > before
    del c
    gc.collect()
    assert wait_until(lambda: checkers() == before, 10)


def test_without_health_checks_a_hung_router_holds_the_call_until_its_deadline(routers):
    from client import DeadlineExceededError

    off = FailoverPolicy(health_check_interval_s=0, keepalive_time_s=None)
    with Client([r.address for r in routers], timeout=1.0, failover=off) as c:
        with pytest.raises(DeadlineExceededError):
            list(c.generate([1, 2, 3], max_tokens=3))
    assert routers[1].resumed == []


def test_keepalive_alone_cuts_a_router_whose_link_went_silent(routers):
    """A router whose host is gone with the connection open (the link goes silent mid-stream),
    health checks off: the unanswered keepalive pings alone cut the connection, and the stream
    fails over. gRPC timed these pings by its own one-minute ping timeout until the options
    set it to keepalive_timeout_s too, so the call sat until its deadline, 20 s here."""
    from tests.blackhole import Blackhole

    hung, ok = routers
    pings = FailoverPolicy(health_check_interval_s=0, keepalive_time_s=0.3,
                           keepalive_timeout_s=0.3, backoff_s=0.0)
    with Blackhole(hung.address) as link, \
            Client([link.address, ok.address], timeout=20, failover=pings) as c:
        stream = c.generate([1, 2, 3], max_tokens=3)
        first = next(stream)
        link.freeze()
        chunks = [first, *stream]
    assert [t for chunk in chunks for t in chunk.token_ids] == [7, 8, 9]
    assert chunks[-1].usage.migrations == 1 and ok.resumed == [[7]]


@pytest.mark.parametrize("bad", [dict(health_check_interval_s=-1),
                                 dict(health_check_misses=0),
                                 dict(health_check_interval_s=None)])
def test_health_check_settings_are_checked(bad):
    with pytest.raises(ValueError, match="health-check"):
        FailoverPolicy(**bad)


@pytest.mark.parametrize("order", ["cut first", "cancel first"])
@pytest.mark.parametrize("call", ["complete", "generate"])
def test_a_callers_cancel_that_lands_with_a_cut_stays_a_cancel(routers, order, call):
    """The caller's cancel (or its asyncio.timeout) and the health checks' cut of the same call
    arrive as one CancelledError: it was read as the cut, and the request failed over to the
    next router and returned, the cancel lost."""
    from client.liveness import cut_router

    hung, ok = routers
    off = FailoverPolicy(health_check_interval_s=0, keepalive_time_s=None, backoff_s=0.0)

    async def run():
        async with AsyncClient([hung.address, ok.address], timeout=60, failover=off) as c:
            if call == "complete":
                task = asyncio.create_task(c.complete([1, 2, 3], max_tokens=2))
            else:
                async def stream():
                    return [chunk async for chunk in c.generate([1, 2, 3], max_tokens=3)]
                task = asyncio.create_task(stream())
            while not (c._routers and len(c._routers[0].calls)):  # on the hung router
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # and the router has it
            if order == "cut first":
                cut_router(c._routers[0], "3 checks missed")  # as the checks do
                task.cancel()
            else:
                task.cancel()
                cut_router(c._routers[0], "3 checks missed")
            with pytest.raises(asyncio.CancelledError):
                await task
            return task

    assert asyncio.run(run()).cancelled()
    assert ok.resumed == []  # nothing failed over


def test_misses_from_a_peers_last_busy_spell_do_not_count_in_its_next():
    """An idle peer is not checked: two misses left when its last call ended, and one in the
    next call, are not three in a row (the call was cut after a single miss)."""
    from client.liveness import WatchedCalls

    missed = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                  grpc.aio.Metadata())
    calls = WatchedCalls()
    key, _ = calls.add(lambda _reason: None)
    assert calls.answered(missed, 3, 0.1) is None
    assert calls.answered(missed, 3, 0.1) is None
    calls.remove(key)  # the call ended; the peer is idle, and not checked
    calls.add(lambda _reason: None)
    assert calls.answered(missed, 3, 0.1) is None
    assert calls.answered(missed, 3, 0.1) is None
    assert "no answer to 3 health checks in a row" in calls.answered(missed, 3, 0.1)
