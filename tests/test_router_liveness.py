"""The router's liveness checks (router/liveness.py) against a real gRPC server on loopback that
plays a worker: its calls never answer, and its health checks answer as a test says.

A worker that leaves ``misses`` checks in a row unanswered has every call on it cut with
UNAVAILABLE (what migrates a request): a Prefill call, a per-request Decode stream and the
requests on a shared DecodeMany stream alike. One that answers, even NOT_SERVING or only now
and then, keeps its calls; and the router's own cancellation of a call stays a cancellation.
"""
from __future__ import annotations

import asyncio
import contextlib
from types import SimpleNamespace

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import common_pb2, worker_pb2, worker_pb2_grpc
from router.decode_mux import DecodeMux
from router.liveness import (LivenessConfig, WatchedCalls, check_loop, watched_stream,
                             watched_unary)

INTERVAL_S = 0.1


class _Health(health_pb2_grpc.HealthServicer):
    """Answers check number i (from 0) as ``script[i % len(script)]``: "hang", "serving" or
    "not-serving"."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.checks = 0

    async def Check(self, request, context):
        what = self.script[self.checks % len(self.script)]
        self.checks += 1
        if what == "hang":
            await asyncio.Event().wait()
        status = health_pb2.HealthCheckResponse.SERVING if what == "serving" \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        return health_pb2.HealthCheckResponse(status=status)


class _Stuck(worker_pb2_grpc.PrefillWorkerServicer, worker_pb2_grpc.DecodeWorkerServicer):
    """A worker whose calls never answer: a stopped process, or a host gone from the network."""

    async def Prefill(self, request, context):
        await asyncio.Event().wait()

    async def Decode(self, request, context):
        await asyncio.Event().wait()
        yield worker_pb2.DecodeChunk()

    async def DecodeMany(self, request_iterator, context):
        async for _ in request_iterator:
            pass
        yield worker_pb2.DecodeBatch()


@contextlib.asynccontextmanager
async def _worker(script: list[str]):
    server = grpc.aio.server()
    health = _Health(script)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    worker_pb2_grpc.add_PrefillWorkerServicer_to_server(_Stuck(), server)
    worker_pb2_grpc.add_DecodeWorkerServicer_to_server(_Stuck(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    handle = SimpleNamespace(channel=channel, calls=WatchedCalls(), worker_id="w0",
                             prefill=worker_pb2_grpc.PrefillWorkerStub(channel),
                             decode=worker_pb2_grpc.DecodeWorkerStub(channel), health=health)
    try:
        yield handle
    finally:
        await channel.close()
        await server.stop(0)


def _decode_request(rid: str) -> worker_pb2.DecodeRequest:
    return worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=[1, 2, 3],
                                    sampling=common_pb2.SamplingParams(max_tokens=4))


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


def _calls(w, mux: DecodeMux) -> list[asyncio.Task]:
    """One call of each kind on the worker: a Prefill, a Decode stream, and two requests on
    its DecodeMany stream."""
    prefill = w.prefill.Prefill(worker_pb2.PrefillRequest(request_id="p", prompt_token_ids=[1]),
                                timeout=60)
    decode = w.decode.Decode(_decode_request("d"), timeout=60)
    return [asyncio.ensure_future(watched_unary(w.calls, prefill)),
            asyncio.ensure_future(_drain(watched_stream(w.calls, decode))),
            asyncio.ensure_future(_drain(mux.decode(_decode_request("m0"), 60))),
            asyncio.ensure_future(_drain(mux.decode(_decode_request("m1"), 60)))]


def test_a_worker_that_stops_answering_health_checks_has_every_call_cut():
    hung: list[tuple[str, str]] = []

    async def run():
        async with _worker(["hang"]) as w:
            mux = DecodeMux(w.decode, w.worker_id, w.calls)
            calls = _calls(w, mux)
            checks = asyncio.ensure_future(check_loop(
                INTERVAL_S, 3, lambda: [w],
                lambda worker, why: hung.append((worker.worker_id, w.calls.cut_all(why)))))
            results = await asyncio.wait_for(
                asyncio.gather(*calls, return_exceptions=True), 30)
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await mux.close()
            return results, w.health.checks

    results, checks = asyncio.run(run())
    # The Prefill call, the Decode stream and the DecodeMany stream: three cut at once.
    assert hung == [("w0", 3)]
    assert checks >= 3
    for e in results:
        assert isinstance(e, grpc.aio.AioRpcError), e
        assert e.code() == grpc.StatusCode.UNAVAILABLE
        assert "no answer to 3 health checks in a row" in e.details()


@pytest.mark.parametrize("script", [["serving"], ["not-serving"], ["hang", "hang", "serving"]])
def test_a_worker_that_answers_keeps_its_calls(script):
    """Answers of any status, or two misses in a row at most, are a live worker: no cut after
    many intervals. The router's own cancel then ends the calls as cancellations."""
    hung = []

    async def run():
        async with _worker(script) as w:
            mux = DecodeMux(w.decode, w.worker_id, w.calls)
            calls = _calls(w, mux)
            checks = asyncio.ensure_future(check_loop(
                INTERVAL_S, 3, lambda: [w],
                lambda worker, why: hung.append(why)))
            while w.health.checks < 12:
                await asyncio.sleep(INTERVAL_S / 2)
            pending = [not c.done() for c in calls]
            for c in calls:
                c.cancel()
            results = await asyncio.gather(*calls, return_exceptions=True)
            checks.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await checks
            await mux.close()
            return pending, results

    pending, results = asyncio.run(run())
    assert hung == []
    assert pending == [True] * 4
    assert all(isinstance(r, asyncio.CancelledError) for r in results), results


def test_watched_calls_are_forgotten_once_done():
    calls = WatchedCalls()
    cut_with = []
    key, cut = calls.add(cut_with.append)
    with calls.watch(SimpleNamespace(cancel=lambda: cut_with.append("call"))) as inner:
        assert calls.cut_all("gone") == 2
    assert cut.reason == inner.reason == "gone" and cut_with == ["gone", "call"]
    calls.remove(key)
    assert calls.cut_all("again") == 0


def test_a_first_item_failing_as_its_caller_is_cancelled_leaves_nothing_unread():
    # A client's deadline cancels the router's handler and fails the decode leg in the same
    # loop turn: the leg's error must not reach asyncio's "never retrieved" log (found by a
    # soak run: dozens of tracebacks in the router's log under short deadlines).
    import gc

    from router.liveness import first_while_watched

    unread = []

    async def run():
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx: unread.append(ctx))
        handler = None

        async def chunks():
            handler.cancel()
            raise RuntimeError("the leg's deadline")
            yield  # an async generator

        handler = asyncio.ensure_future(first_while_watched(WatchedCalls(), chunks()))
        with pytest.raises(asyncio.CancelledError):
            await handler
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(run())
    gc.collect()
    assert unread == []


async def _pulling_leg():
    """A decode leg waiting for its KV, whose cleanup takes loop turns (its cancel to the
    worker)."""
    try:
        await asyncio.sleep(100)
        yield "chunk"
    finally:
        await asyncio.sleep(0)
        await asyncio.sleep(0)


def test_a_cut_of_the_kv_source_blames_the_source():
    """The prefill worker hung while the decode worker pulled from it: the leg's error is
    marked as the KV source's failure, so the migration avoids the prefill worker, not the
    healthy decode worker the leg was on."""
    from engine.call_abort import kv_source_failed
    from router.liveness import first_while_watched

    async def run():
        calls = WatchedCalls()
        leg = asyncio.ensure_future(first_while_watched(calls, _pulling_leg()))
        await asyncio.sleep(0.01)
        calls.cut_all("worker prefill-1 hung")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await leg
        return err.value

    e = asyncio.run(run())
    assert e.code() == grpc.StatusCode.UNAVAILABLE and e.details() == "worker prefill-1 hung"
    assert kv_source_failed(e)


def test_a_callers_cancel_landing_after_a_cut_stays_a_cancel():
    """The caller's cancel (client, deadline, CancelRequest) landing while the cut leg cleans
    up was swallowed with the leg's own CancelledError, and the request migrated."""
    from router.liveness import first_while_watched

    async def run():
        calls = WatchedCalls()
        handler = asyncio.ensure_future(first_while_watched(calls, _pulling_leg()))
        await asyncio.sleep(0.01)
        calls.cut_all("worker prefill-1 hung")
        await asyncio.sleep(0)  # the handler wakes, and waits for the leg's cleanup
        await asyncio.sleep(0)
        handler.cancel()
        with pytest.raises(asyncio.CancelledError):
            await handler
        return handler

    assert asyncio.run(run()).cancelled()


@pytest.mark.parametrize("bad", [dict(interval_s=-1), dict(interval_s=0.001),
                                 dict(interval_s=True), dict(misses=0), dict(misses=2.5),
                                 dict(interval_s="2")])
def test_liveness_settings_are_checked(bad):
    with pytest.raises(ValueError, match="health-check"):
        LivenessConfig(**bad)
    assert not LivenessConfig(interval_s=0).enabled and LivenessConfig().enabled
