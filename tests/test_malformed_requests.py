"""A request that does not parse ends INVALID_ARGUMENT on a real GrpcServer (engine/
malformed_requests.py), for the four kinds of method, the health and reflection services
included, without reaching the service; parsed requests are served as before, and an API key
is still asked for first."""
from __future__ import annotations

import asyncio
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from engine.grpc_server import GrpcServer, ServerConfig
from router.auth import ApiKeyInterceptor
from tests.malformed_wire import GARBAGE, assert_every_method_refuses_malformed, bad_utf8, \
    four_kinds_handler, send_raw

# The router's prefix, so that ApiKeyInterceptor guards it.
SERVICE = "pdserve.v1.Router"
Req, Resp = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse
KINDS = {"UnaryUnary": (False, False), "UnaryStream": (False, True),
         "StreamUnary": (True, False), "StreamStream": (True, True)}


class _Echo:
    """Answers SERVING twice (streams) or once; counts the requests that reached it."""

    def __init__(self) -> None:
        self.seen: list = []

    async def unary_unary(self, request, context):
        self.seen.append(request)
        return Resp(status=Resp.SERVING)

    async def unary_stream(self, request, context):
        self.seen.append(request)
        for _ in range(2):
            yield Resp(status=Resp.SERVING)

    async def stream_unary(self, requests, context):
        async for request in requests:
            self.seen.append(request)
        return Resp(status=Resp.SERVING)

    async def stream_stream(self, requests, context):
        async for request in requests:
            self.seen.append(request)
            yield Resp(status=Resp.SERVING)

    def handler(self) -> grpc.GenericRpcHandler:
        return four_kinds_handler(SERVICE, self, Req, Resp)


@pytest.fixture
def served(request):
    """(address, the Echo servicer, the API key or None: the test's indirect parameter),
    served from a loop of its own."""
    key = getattr(request, "param", None)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    echo = _Echo()

    async def start() -> GrpcServer:
        interceptors = [ApiKeyInterceptor(key)] if key else None
        server = GrpcServer(ServerConfig(), [SERVICE], interceptors)
        server.server.add_generic_rpc_handlers((echo.handler(),))
        await server.start()
        return server

    server = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    yield server.address, echo, key
    asyncio.run_coroutine_threadsafe(server.server.stop(0), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()


@pytest.mark.parametrize("method", sorted(KINDS))
def test_each_kind_of_method_refuses_bytes_that_do_not_parse(served, method):
    address, echo, _ = served
    streams = KINDS[method]
    with grpc.insecure_channel(address) as channel:
        for payload in (GARBAGE, bad_utf8(Req.DESCRIPTOR)):
            err = send_raw(channel, f"/{SERVICE}/{method}", *streams, payload)
            assert err is not None and err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
            assert err.details().startswith("the request message does not parse: ")
            assert "Unexpected" not in err.details()
        assert echo.seen == []  # refused before the service
        # A message that parses is served as before.
        good = Req(service="x").SerializeToString()
        assert send_raw(channel, f"/{SERVICE}/{method}", *streams, good) is None
        assert echo.seen == [Req(service="x")]


def test_a_stream_refuses_at_its_first_malformed_message(served):
    address, echo, _ = served
    with grpc.insecure_channel(address) as channel:
        call = channel.stream_stream(f"/{SERVICE}/StreamStream")
        good = Req(service="a").SerializeToString()
        replies = call(iter([good, GARBAGE, good]), timeout=30)
        with pytest.raises(grpc.RpcError) as err:
            assert next(replies)  # the first message's answer
            list(replies)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert echo.seen == [Req(service="a")]


def test_health_and_reflection_refuse_them_too(served):
    address, _, _ = served
    with grpc.insecure_channel(address) as channel:
        health = health_pb2.DESCRIPTOR.services_by_name["Health"]
        reflection = reflection_pb2.DESCRIPTOR.services_by_name["ServerReflection"]
        for service in (health, reflection):  # List is synchronous: wrapped as such
            assert assert_every_method_refuses_malformed(channel, service) \
                > len(service.methods)


@pytest.mark.parametrize("served", ["k3y"], indirect=True)
def test_a_keyed_service_asks_for_the_key_before_reading_the_message(served):
    address, echo, key = served
    with grpc.insecure_channel(address) as channel:
        err = send_raw(channel, f"/{SERVICE}/UnaryUnary", False, False, GARBAGE)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED  # not a word about the message
        err = send_raw(channel, f"/{SERVICE}/UnaryUnary", False, False, GARBAGE,
                       metadata=(("authorization", f"Bearer {key}"),))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert echo.seen == []
