"""The router's own refusals: a gRPC status and the message its caller reads."""
from __future__ import annotations

import asyncio

import grpc


class RouterRejectError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a request that failed with ``e`` ends with."""
    code = getattr(e, "code", None)
    if isinstance(code, grpc.StatusCode):  # RouterRejectError, NoWorkerError
        return code, str(e)
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, grpc.aio.AioRpcError):
        # A worker's status passes through (its message names the problem).
        return e.code(), e.details() or str(e.code())
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"
