"""The standard gRPC health service, with Watch streams that end when the server stops.

grpc's own servicer keeps a Watch stream open for as long as the server runs, and a draining
server counts no such stream: its stop then waited out the whole grace period for each
client that watches (gRPC's client-side health checking does), and cut it at the end. Here a
watch ends, OK, once the server enters its graceful shutdown and NOT_SERVING has gone out.
"""
from __future__ import annotations

import asyncio

from grpc_health.v1 import health, health_pb2

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# How long a watch gets, once the shutdown began, to write its NOT_SERVING.
_LAST_WRITE_S = 1.0


class HealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._closing = asyncio.Event()

    async def Watch(self, request: health_pb2.HealthCheckRequest, context) -> None:
        sent = _Sent(context)
        watch = asyncio.ensure_future(super().Watch(request, sent))
        closing = asyncio.ensure_future(self._closing.wait())
        try:
            await asyncio.wait({watch, closing}, return_when=asyncio.FIRST_COMPLETED)
            if not watch.done():
                # Stopped between its writes: cancelled in one, the write stayed in flight
                # and the call took no other operation (it ended with an error).
                await sent.settled(NOT_SERVING, _LAST_WRITE_S)
        finally:
            closing.cancel()
            if not watch.done():
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        if not watch.cancelled():
            watch.result()  # it ended by itself: as it ended

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        self._closing.set()


class _Sent:
    """A Watch call's context that tells what it last wrote and whether a write is on."""

    def __init__(self, context) -> None:
        self._context = context
        self.last: int | None = None
        self.writing = False

    async def write(self, message: health_pb2.HealthCheckResponse) -> None:
        self.writing = True
        try:
            await self._context.write(message)
            self.last = message.status
        finally:
            self.writing = False

    async def settled(self, status: int, within_s: float) -> None:
        """Until ``status`` was written and no write is on, for at most ``within_s``."""
        loop = asyncio.get_running_loop()
        end = loop.time() + within_s
        while (self.writing or self.last != status) and loop.time() < end:
            await asyncio.sleep(0.01)

    def __getattr__(self, name: str):
        return getattr(self._context, name)
