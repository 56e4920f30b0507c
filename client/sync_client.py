"""The blocking client: the same calls as AsyncClient, on a plain gRPC channel."""
from __future__ import annotations

from collections.abc import Iterator

import grpc

from client.async_client import CHANNEL_OPTIONS
from client.errors import DeadlineExceededError, error_from_rpc
from client.types import (Completion, GenerationChunk, build_request, chunk_from_proto,
                          completion_from_proto)
from protos import router_pb2_grpc


class Client:
    """``with Client("host:port") as c: for chunk in c.generate("Hi"): ...``

    Closing the iterator of ``generate`` early (``break`` or ``.close()``) cancels the call.
    """

    def __init__(self, address: str, *, timeout: float | None = None) -> None:
        self.address = address
        self.timeout = timeout
        self._channel = grpc.insecure_channel(address, options=CHANNEL_OPTIONS)
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def generate(self, prompt: str | list[int], *, request_id: str | None = None,
                 timeout: float | None = None, **sampling) -> Iterator[GenerationChunk]:
        req = build_request(prompt, request_id, sampling)  # bad arguments raise here, not later
        call = self._stub.Generate(req, timeout=timeout if timeout is not None else self.timeout)
        return self._stream(call)

    @staticmethod
    def _stream(call) -> Iterator[GenerationChunk]:
        try:
            for msg in call:
                yield chunk_from_proto(msg)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        finally:
            call.cancel()

    def complete(self, prompt: str | list[int], *, request_id: str | None = None,
                 timeout: float | None = None, **sampling) -> Completion:
        req = build_request(prompt, request_id, sampling)
        try:
            msg = self._stub.Complete(req, timeout=timeout if timeout is not None else self.timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e) from None
        return completion_from_proto(msg)

    def wait_ready(self, timeout: float = 30.0) -> None:
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise DeadlineExceededError(f"router {self.address} not reachable in {timeout}s") \
                from None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
