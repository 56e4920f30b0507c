"""What engine/handler_guards.py's interceptor costs a call: a GrpcServer's health Check
(unary) and a server stream, served with it and with no interceptor at all (what a service
without an API key had before), alternating in rounds; a grpc.aio client on loopback.

    python -m bench.interceptor_cost [--unary N] [--stream-messages N] [--rounds N]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

import engine.grpc_server as grpc_server
from engine.grpc_server import GrpcServer, ServerConfig

_REQ, _RESP = health_pb2.HealthCheckRequest, health_pb2.HealthCheckResponse


@dataclass
class Cost:
    unary_us: float  # per call
    stream_us: float  # per streamed message


def _server(intercepted: bool, messages: int) -> GrpcServer:
    make = grpc_server.grpc.aio.server
    if not intercepted:
        grpc_server.grpc.aio.server = lambda **kw: make(**{**kw, "interceptors": None})
    try:
        server = GrpcServer(ServerConfig(), ["bench.Stream"])
    finally:
        grpc_server.grpc.aio.server = make

    async def stream(request, context):
        reply = _RESP(status=_RESP.SERVING)
        for _ in range(messages):
            yield reply

    server.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "bench.Stream", {"Run": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=_REQ.FromString,
            response_serializer=_RESP.SerializeToString)}),))
    return server


async def _measure(intercepted: bool, calls: int, messages: int) -> Cost:
    server = _server(intercepted, messages)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            await stub.Check(_REQ())  # the connection, outside the timing
            t = time.perf_counter()
            for _ in range(calls):
                await stub.Check(_REQ())
            unary = (time.perf_counter() - t) / calls
            run = channel.unary_stream("/bench.Stream/Run",
                                       request_serializer=_REQ.SerializeToString,
                                       response_deserializer=_RESP.FromString)
            t, n = time.perf_counter(), 0
            async for _ in run(_REQ()):
                n += 1
            if n != messages:
                raise RuntimeError(f"the stream sent {n} messages, not {messages}")
            return Cost(unary * 1e6, (time.perf_counter() - t) / n * 1e6)
    finally:
        await server.server.stop(0)


async def compare(calls: int, messages: int, rounds: int) -> dict[str, Cost]:
    """Median costs with and without the interceptor over ``rounds`` alternating rounds."""
    runs: dict[bool, list[Cost]] = {False: [], True: []}
    for _ in range(rounds):
        for intercepted in (False, True):
            runs[intercepted].append(await _measure(intercepted, calls, messages))
    return {name: Cost(statistics.median(c.unary_us for c in runs[k]),
                       statistics.median(c.stream_us for c in runs[k]))
            for name, k in (("without", False), ("with", True))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--unary", type=int, default=3000, help="health Checks a round")
    p.add_argument("--stream-messages", type=int, default=20000, help="messages a round")
    p.add_argument("--rounds", type=int, default=6)
    a = p.parse_args(argv)
    if min(a.unary, a.stream_messages, a.rounds) < 1:
        p.error("--unary, --stream-messages and --rounds must be >= 1")
    costs = asyncio.run(compare(a.unary, a.stream_messages, a.rounds))
    for name, c in costs.items():
        print(f"{name} the interceptor: {c.unary_us:.1f} us a unary call, "
              f"{c.stream_us:.2f} us a streamed message")
    w, wo = costs["with"], costs["without"]
    print(f"with / without: unary {w.unary_us / wo.unary_us:.3f}, "
          f"stream {w.stream_us / wo.stream_us:.3f}")


if __name__ == "__main__":
    main()
