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

from client.errors import never_handled

try:
    from grpc._cython.cygrpc import ExecuteBatchError  # grpc.aio does not export it
except ImportError:  # a grpc that moved it: every service must still start; late sends then
    ExecuteBatchError = ()  # log grpc's traceback again, as before this module existed


# Trailing metadata of a worker's refusal before doing any of the request (draining, its
# engine stopped, full): the router may send the request to another worker at no cost, as
# no work was lost (DecodeError.refused says the same inside a multiplexed decode stream).
REFUSED_KEY = "pdserve-refused"
REFUSED = ((REFUSED_KEY, "1"),)
# Trailing metadata of a decode worker's failure to read the request's KV from its prefill
# worker: the router blames (and avoids) that worker, not the decode worker that said so.
KV_SOURCE_FAILED_KEY = "pdserve-kv-source-failed"
KV_SOURCE_FAILED = ((KV_SOURCE_FAILED_KEY, "1"),)


def _marked(e: BaseException, key: str) -> bool:
    # An ended call's error (grpc.aio's, or a blocking stub's) carries its trailing metadata.
    if not isinstance(e, grpc.RpcError) or not callable(getattr(e, "trailing_metadata", None)):
        return False
    return any(k == key for k, _ in (e.trailing_metadata() or ()))


# How gRPC fails a call that found no connection to open (the peer's port closed): the request
# never left this process.
_NO_CONNECTION = "failed to connect to all addresses"


def was_refused(e: BaseException) -> bool:
    """Whether a call's error says the worker took none of the request: its refusal before any
    work (``REFUSED_KEY``), a call that never reached it (no connection could be opened: a
    worker that exited since the router last read the registry), or one its stopping server
    ended before any handler took it (client/errors.py's ``never_handled``)."""
    if _marked(e, REFUSED_KEY) or never_handled(e):
        return True
    return (isinstance(e, grpc.RpcError) and callable(getattr(e, "code", None))
            and e.code() == grpc.StatusCode.UNAVAILABLE
            and (e.details() or "").startswith(_NO_CONNECTION))


def kv_source_failed(e: BaseException) -> bool:
    """Whether a decode call failed reading the KV from its source (``KV_SOURCE_FAILED_KEY``)."""
    return _marked(e, KV_SOURCE_FAILED_KEY)


class CallEnded(asyncio.CancelledError):
    """A send found the call ended under the handler: the call's own cancellation (its
    client's cancel, its deadline), which gRPC has not cancelled the handler's task for yet
    (engine/stray_cancels.py must not take it for the handler's own)."""


@contextlib.asynccontextmanager
async def _ended_call_cancels():
    try:
        yield
    except ExecuteBatchError:
        raise CallEnded from None


# Characters of a status message; percent-encoded in the header, the worst UTF-8 character
# takes 12 bytes, so 1024 of them stay under gRPC's 16 KiB.
MAX_STATUS_CHARS = 1024


def capped(message: str, limit: int = MAX_STATUS_CHARS) -> str:
    """``message``, or as much of it as fits in ``limit`` characters with how many more there
    were; at most ``limit`` characters either way, so a capped message is not cut again."""
    if len(message) <= limit:
        return message
    keep = limit - len(f"…({len(message)} more characters)")
    return f"{message[:keep]}…({len(message) - keep} more characters)"


async def abort_call(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                     message: str, trailing_metadata: tuple = ()) -> NoReturn:
    """Ends the call with ``code`` and ``message``, cut to MAX_STATUS_CHARS: a message may
    quote the caller's own text (a handle's backend, a role), and gRPC carries it in a header,
    where one past its 16 KiB limit turns the status into RESOURCE_EXHAUSTED ("received
    metadata size exceeds hard limit"), which reads as a full worker, in place of the one
    meant."""
    async with _ended_call_cancels():
        await context.abort(code, capped(message), trailing_metadata)
    raise AssertionError("context.abort returned")  # it always raises AbortError


async def write_message(context: grpc.aio.ServicerContext, message) -> None:
    """``context.write``, in a server-streaming handler that writes rather than yields: a
    generator's messages are written by grpc, out of the handler's reach."""
    async with _ended_call_cancels():
        await context.write(message)
