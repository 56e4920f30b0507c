"""How often gRPC C-core's EventEngine threads woke in a process (engine/grpc_experiments.py).

Run as a script it is a process of its own: ``apply`` first sets pdserve's default the way
``engine.cli.main`` does, anything else leaves the environment as it is; it then streams
MESSAGES paced messages from a grpc.aio server to a channel of its own and prints how many
times its EventEngine threads woke meanwhile.
"""
from __future__ import annotations

import asyncio
import os
import sys

MESSAGES = 100


def event_engine_wakeups(pid: int | str = "self") -> int:
    """Voluntary context switches summed over the threads of ``pid`` that gRPC C-core named
    ``event_engine`` (its pollers and workers)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "event_engine":
                    continue
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                status = f.read()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        total += int(status.split("voluntary_ctxt_switches:")[1].split()[0])
    return total


async def _stream() -> int:
    import grpc

    def same(b: bytes) -> bytes:
        return b

    async def go(request, context):
        for _ in range(MESSAGES):
            await asyncio.sleep(0.002)  # one message a wakeup, as a decode step's token
            await context.write(b"t")

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("probe.Probe", {
        "Go": grpc.unary_stream_rpc_method_handler(go, request_deserializer=same,
                                                   response_serializer=same)})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/probe.Probe/Go", request_serializer=same,
                                        response_deserializer=same)
            async for _ in call(b""):  # connected and warm before counting
                pass
            before, got = event_engine_wakeups(), 0
            async for _ in call(b""):
                got += 1
            woke = event_engine_wakeups() - before
    finally:
        await server.stop(None)
    if got != MESSAGES:
        raise RuntimeError(f"streamed {got} messages of {MESSAGES}")
    return woke


if __name__ == "__main__":
    if sys.argv[1:] == ["apply"]:
        from engine.grpc_experiments import apply_grpc_experiments

        apply_grpc_experiments()
    print(asyncio.run(_stream()))
