"""Sending on a gRPC call whose caller may already be gone: an error status (every service's
refusals) or a streamed message (the router's Generate).

A send fails (grpc's ExecuteBatchError) only when the call has already ended under the
handler: its deadline passed, or the client left, in the instant the handler refused it or
wrote to it. Nothing can reach the caller then, and grpc logs a handler that raises that error
as a failure with a traceback (a soak run of ~20,000 requests met it 8 times, a run of 3,000
requests with 20-300 ms deadlines 8 times); a handler that ends cancelled is logged at debug
level, as a client's cancel is.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import NoReturn

import grpc

try:
    from grpc._cython.cygrpc import ExecuteBatchError  # grpc.aio does not export it
except ImportError:  # a grpc that moved it: every service must still start; late sends then
    ExecuteBatchError = ()  # log grpc's traceback again, as before this module existed


@contextlib.asynccontextmanager
async def _ended_call_cancels():
    try:
        yield
    except ExecuteBatchError:
        raise asyncio.CancelledError from None


async def abort_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     message: str, trailing_metadata: tuple = ()) -> NoReturn:
    async with _ended_call_cancels():
        await context.abort(code, message, trailing_metadata)
    raise AssertionError("context.abort returned")  # it always raises AbortError


async def write_message(context: grpc.aio.ServicerContext, message) -> None:
    """``context.write``, in a server-streaming handler that writes rather than yields: a
    generator's messages are written by grpc, out of the handler's reach."""
    async with _ended_call_cancels():
        await context.write(message)
