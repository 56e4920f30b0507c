"""The asyncio client: one channel, reused for every call, until close()."""
from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from client.errors import error_from_rpc
from client.types import (Completion, GenerationChunk, build_request, chunk_from_proto,
                          completion_from_proto)
from protos import router_pb2_grpc

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024),
                   ("grpc.max_send_message_length", 64 * 1024 * 1024)]


class AsyncClient:
    """``async with AsyncClient("host:port") as c: async for chunk in c.generate("Hi"): ...``

    ``timeout`` (seconds) is a per-call deadline that the router passes on to the workers;
    leaving a ``generate`` loop early cancels the call, and the workers free its KV blocks.
    """

    def __init__(self, address: str, *, timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    async def generate(self, prompt: str | list[int], *, request_id: str | None = None,
                       timeout: float | None = None, **sampling) -> AsyncIterator[GenerationChunk]:
        req = build_request(prompt, request_id, sampling)
        call = self._stub.Generate(req, timeout=timeout if timeout is not None else self.timeout)
        try:
            async for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()  # a no-op once the stream ended; frees the request when cut short

    async def complete(self, prompt: str | list[int], *, request_id: str | None = None,
                       timeout: float | None = None, **sampling) -> Completion:
        req = build_request(prompt, request_id, sampling)
        try:
            msg = await self._stub.Complete(
                req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return completion_from_proto(msg)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        """Waits until the router's channel connects (raises DeadlineExceededError)."""
        import asyncio

        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout)
        except asyncio.TimeoutError:
            from client.errors import DeadlineExceededError
            raise DeadlineExceededError(f"router {self.address} not reachable in {timeout}s") \
                from None

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()



