"""Requests that do not parse end with INVALID_ARGUMENT, on every pdserve service.

gRPC parses a request before the handler sees it; a message protobuf refuses (a string field
that is not UTF-8, which a client in a language without Python's checks can send; bytes that
are no message at all) ended the call with UNKNOWN and the parser's exception as the status
text ("Unexpected <class 'google.protobuf.message.DecodeError'>: ..."): a server-side error to
the caller's eyes, and one a retrying client would retry. The interceptor gives each method's
parser a wrapper that hands the handler a ``Malformed`` marker instead of raising, and each
handler a wrapper that refuses the marker before the service sees it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from engine.call_abort import abort_call


@dataclass(frozen=True)
class Malformed:
    """What a method's parser returns for bytes that are not its request message."""
    error: str


def _tolerant(deserializer: Callable | None) -> Callable | None:
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


async def _refuse(context: grpc.aio.ServicerContext, bad: Malformed):
    await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, _refusal(bad))


def _unary_request(behavior: Callable, streaming: bool) -> Callable:
    """``behavior`` refusing a Malformed request first (a synchronous one too: grpc runs those
    in its executor, and the health service's List is one)."""
    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            if isinstance(request, Malformed):
                await _refuse(context, request)
            # Closed with this one, as grpc would have closed it (its finally frees blocks).
            async with contextlib.aclosing(behavior(request, context)) as responses:
                async for response in responses:
                    yield response
        return stream
    if inspect.iscoroutinefunction(behavior):
        async def unary(request, context):
            if isinstance(request, Malformed):
                await _refuse(context, request)
            return await behavior(request, context)
        return unary

    def sync(request, context):
        if isinstance(request, Malformed):  # no await here: the status, and no message
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details(_refusal(request))
            return iter(()) if streaming else None
        return behavior(request, context)
    return sync


def _stream_request(behavior: Callable) -> Callable | None:
    """``behavior`` given a request iterator that refuses the call at its first Malformed
    message (handlers that ``context.read()`` instead see the marker itself); None for a
    synchronous one, left as it is."""
    async def checked(requests: AsyncIterator, context) -> AsyncIterator:
        async for request in requests:
            if isinstance(request, Malformed):
                await _refuse(context, request)
            yield request

    if inspect.isasyncgenfunction(behavior):
        async def stream(requests, context):
            async with contextlib.aclosing(behavior(checked(requests, context), context)) \
                    as responses:
                async for response in responses:
                    yield response
        return stream
    if inspect.iscoroutinefunction(behavior):
        async def unary(requests, context):
            return await behavior(checked(requests, context), context)
        return unary
    return None


_KINDS = {
    (False, False): ("unary_unary", functools.partial(_unary_request, streaming=False),
                     grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", functools.partial(_unary_request, streaming=True),
                    grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", _stream_request, grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", _stream_request, grpc.stream_stream_rpc_method_handler),
}


def refusing_malformed(handler: grpc.RpcMethodHandler | None) -> grpc.RpcMethodHandler | None:
    """``handler`` with its parser and behavior wrapped as the module says (unchanged where
    either cannot be)."""
    if handler is None or handler.request_deserializer is None:
        return handler
    attr, wrap, make = _KINDS[(bool(handler.request_streaming),
                               bool(handler.response_streaming))]
    behavior = wrap(getattr(handler, attr))
    if behavior is None:
        return handler
    return make(behavior, request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer)


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (the service's handler, its wrapper): wrapped once, not on every call.
        self._wrapped: dict[str, tuple] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        known = self._wrapped.get(details.method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = refusing_malformed(handler)
        if handler is not None:
            self._wrapped[details.method] = (handler, wrapped)
        return wrapped
