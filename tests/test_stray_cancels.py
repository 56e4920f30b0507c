"""A handler's own CancelledError ends its call INTERNAL on a real GrpcServer
(engine/stray_cancels.py), for the four kinds of method, where grpc.aio alone leaves the caller
waiting until its deadline; the call's own cancellations (the caller's cancel, its deadline)
stay what they were."""
from __future__ import annotations

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2

from engine.grpc_server import GrpcServer, ServerConfig
from tests.malformed_wire import four_kinds_handler

SERVICE = "pdserve.v1.StrayTest"
Req, Resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
# Long: a call the net misses would end DEADLINE_EXCEEDED, which the tests tell apart.
TIMEOUT_S = 30.0
STRAY_LOG = "the handler was cancelled, not its call"


class _Servicer:
    """Each method answers once, then awaits a future that another task cancels (the stray
    cancel of the module's docstring), or, with ``hold``, waits until its call is cancelled."""

    def __init__(self, hold: bool = False) -> None:
        self.hold = hold
        self.waiting = 0  # handlers that reached their wait
        self.ended: list[str] = []  # how each handler ended

    async def _stray(self, name: str) -> None:
        if self.hold:
            self.waiting += 1
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.ended.append(f"{name} cancelled")
                raise
        lost = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(lost.cancel)
        await lost

    async def unary_unary(self, request, context):
        await self._stray("unary_unary")

    async def unary_stream(self, request, context):
        yield Resp(status=Resp.SERVING)
        await self._stray("unary_stream")

    async def stream_unary(self, requests, context):
        async for _ in requests:
            break
        await self._stray("stream_unary")

    async def stream_stream(self, requests, context):
        async for _ in requests:
            yield Resp(status=Resp.SERVING)
            await self._stray("stream_stream")

    def handler(self) -> grpc.GenericRpcHandler:
        return four_kinds_handler(SERVICE, self, Req, Resp)


async def _requests():
    yield Req()
    await asyncio.Event().wait()  # the stream stays open: the server must end the call


def _call(channel: grpc.aio.Channel, kind: str, timeout: float):
    path = f"/{SERVICE}/{kind}"
    kw = dict(request_serializer=Req.SerializeToString, response_deserializer=Resp.FromString)
    if kind == "UnaryUnary":
        return channel.unary_unary(path, **kw)(Req(), timeout=timeout)
    if kind == "UnaryStream":
        return channel.unary_stream(path, **kw)(Req(), timeout=timeout)
    if kind == "StreamUnary":
        return channel.stream_unary(path, **kw)(_requests(), timeout=timeout)
    return channel.stream_stream(path, **kw)(_requests(), timeout=timeout)


async def _outcome(call) -> tuple[int, grpc.StatusCode, str]:
    """Messages received before the call ended, and how it ended."""
    got = 0
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                got += 1
        else:
            await call
    except grpc.aio.AioRpcError as e:
        return got, e.code(), e.details() or ""
    return got, grpc.StatusCode.OK, ""


async def _serve(servicer: _Servicer, body):
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0), [SERVICE])
    server.server.add_generic_rpc_handlers((servicer.handler(),))
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            return await body(channel)
    finally:
        await server.server.stop(0)


KINDS = {"UnaryUnary": "unary_unary", "UnaryStream": "unary_stream",
         "StreamUnary": "stream_unary", "StreamStream": "stream_stream"}


@pytest.mark.parametrize("kind", KINDS)
def test_a_handlers_own_cancel_ends_its_call_internal(kind, caplog):
    servicer = _Servicer()

    async def body(channel):
        return await _outcome(_call(channel, kind, TIMEOUT_S))

    with caplog.at_level(logging.ERROR, logger="engine.stray_cancels"):
        got, code, details = asyncio.run(_serve(servicer, body))
    assert code == grpc.StatusCode.INTERNAL, (code, details)
    assert f"/{SERVICE}/{kind}" in details
    assert got == (1 if kind in ("UnaryStream", "StreamStream") else 0)
    # The log has the traceback: where the handler was cancelled.
    records = [r for r in caplog.records if STRAY_LOG in r.getMessage()]
    assert len(records) == 1 and records[0].exc_info is not None


@pytest.mark.parametrize("kind", KINDS)
def test_the_callers_cancel_and_deadline_stay_theirs(kind, caplog):
    """A handler waiting when its caller cancels, or its deadline passes, is cancelled as
    before: the caller sees its own cancel or DEADLINE_EXCEEDED, and the net logs nothing."""
    servicer = _Servicer(hold=True)

    async def body(channel):
        deadline = await _outcome(_call(channel, kind, 0.5))
        call = _call(channel, kind, TIMEOUT_S)
        reader = asyncio.ensure_future(_outcome(call))
        while servicer.waiting < 2:
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reader
        while len(servicer.ended) < 2:
            await asyncio.sleep(0.01)
        return deadline

    with caplog.at_level(logging.ERROR, logger="engine.stray_cancels"):
        _, code, _ = asyncio.run(_serve(servicer, body))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.ended == [f"{KINDS[kind]} cancelled"] * 2
    assert not [r for r in caplog.records if STRAY_LOG in r.getMessage()]
