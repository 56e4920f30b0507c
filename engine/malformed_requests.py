"""Requests that do not parse end with INVALID_ARGUMENT, on every pdserve service.

gRPC parses a request before the handler sees it; a message protobuf refuses (a string field
that is not UTF-8, which a client in a language without Python's checks can send; bytes that
are no message at all) ended the call with UNKNOWN and the parser's exception as the status
text ("Unexpected <class 'google.protobuf.message.DecodeError'>: ..."): a server-side error to
the caller's eyes, and one a retrying client would retry. Each method's parser gets a wrapper
that hands the handler a ``Malformed`` marker instead of raising, and the handler's wrapper
(engine/handler_guards.py) refuses the marker before the service sees it.
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import NoReturn

import grpc

from engine.call_abort import abort_call


@dataclass(frozen=True)
class Malformed:
    """What a method's parser returns for bytes that are not its request message."""
    error: str


def tolerant(deserializer: Callable | None) -> Callable | None:
    if deserializer is None:  # the handler takes raw bytes: nothing to parse
        return None

    def parse(data: bytes):
        try:
            return deserializer(data)
        except Exception as e:  # noqa: BLE001 - whatever the parser raises, the bytes are bad
            return Malformed(str(e) or type(e).__name__)
    return parse


def _refusal(bad: Malformed) -> str:
    return f"the request message does not parse: {bad.error}"


async def refuse(context: grpc.aio.ServicerContext, bad: Malformed) -> NoReturn:
    await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, _refusal(bad))


async def refusing_messages(requests: AsyncIterator, context) -> AsyncIterator:
    """A client stream's messages, the call refused at the first Malformed one (handlers that
    ``context.read()`` instead see the marker itself)."""
    async for request in requests:
        if isinstance(request, Malformed):
            await refuse(context, request)
        yield request


def refusing_sync(behavior: Callable, streaming: bool) -> Callable:
    """A synchronous handler of one request message refusing a Malformed one first (grpc runs
    those in its executor: the health service's List is one)."""
    def sync(request, context):
        if isinstance(request, Malformed):  # no await here: the status, and no message
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(_refusal(request))
            return iter(()) if streaming else None
        return behavior(request, context)
    return sync
