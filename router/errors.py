"""The router's own refusals: a gRPC status and the message its caller reads.

A message may quote the client's own text (a role, a request id, what a chat template said
about the conversation): every status the router and its admin service end a call with goes
through ``refuse``, which cuts it (engine/call_abort.py's ``capped``, as every service's
refusals are), since gRPC carries the message in a header and a header past its 16 KiB limit
turns the status into RESOURCE_EXHAUSTED ("received metadata size exceeds hard limit") in
place of the one meant.
"""
from __future__ import annotations

import asyncio
from typing import NoReturn

import grpc

from client.errors import never_handled
from client.failover import MIGRATIONS_SPENT_KEY, MODEL_MISMATCH_KEY
from engine.call_abort import abort_call

# Characters of a client's string quoted inside a message (a worker id, a role).
MAX_QUOTED_CHARS = 64
# Trailing metadata of the admin service's UNAVAILABLE when its registry (Redis) does not
# answer: `pdserve up` then cannot tell whether the router lists a worker it started again,
# which registers once Redis is back (router/launcher.py). A mark, not the message's words:
# any other UNAVAILABLE may mention the registry.
REGISTRY_UNREACHABLE_KEY = "pdserve-registry-unreachable"
REGISTRY_UNREACHABLE = ((REGISTRY_UNREACHABLE_KEY, "1"),)


class RouterRejectError(Exception):
    # A trailing-metadata key the status carries, for the SDK's next attempt
    # (client/failover.py); None: none.
    mark: str | None = None

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class MigrationsSpent(RouterRejectError):
    """A request's worker failed after it moved as often as --migration-limit allows: the
    worker's status, marked so that the SDK does not start it over (client/failover.py)."""

    mark = MIGRATIONS_SPENT_KEY

    def __init__(self, e: grpc.aio.AioRpcError) -> None:
        super().__init__(*status_of(e))


class ModelMismatch(RouterRejectError):
    """A request expects another model than the router's (``GenerateRequest.expect_model``):
    marked so that the SDK takes it to another router (client/failover.py)."""

    mark = MODEL_MISMATCH_KEY

    def __init__(self, message: str) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION, message)


def quoted(value: str, limit: int = MAX_QUOTED_CHARS) -> str:
    """A client's string in a message: its repr, cut to ``limit`` characters first."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}…({len(value) - limit} more characters)"


def status_of(e: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message a request that failed with ``e`` ends with (``refuse``
    cuts the message)."""
    code = getattr(e, "code", None)
    if isinstance(code, grpc.StatusCode):  # RouterRejectError, NoWorkerError
        return code, str(e)
    if isinstance(e, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(e)
    if isinstance(e, grpc.aio.AioRpcError):
        if never_handled(e):  # a worker stopped under it: not the client's cancel
            return grpc.StatusCode.UNAVAILABLE, "a worker stopped before it took the call"
        # A worker's status passes through (its message names the problem).
        return e.code(), e.details() or str(e.code())
    if isinstance(e, (asyncio.CancelledError, GeneratorExit)):
        return grpc.StatusCode.CANCELLED, "cancelled by the client"
    return grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}"


async def refuse(context: grpc.aio.ServicerContext, code: grpc.StatusCode,
                 message: str, trailing_metadata: tuple = ()) -> NoReturn:
    """Ends the call with ``code`` and the capped ``message`` (engine/call_abort.py)."""
    await abort_call(context, code, message, trailing_metadata)
