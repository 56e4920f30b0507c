"""The wrapper every pdserve gRPC method runs in, put on by one server interceptor: a request
that does not parse is refused INVALID_ARGUMENT (engine/malformed_requests.py), and a handler's
own CancelledError ends its call INTERNAL (engine/stray_cancels.py). One wrapper for both, so
that a streamed message crosses one more generator, not two."""
from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import Callable

import grpc

from engine.malformed_requests import Malformed, refuse, refusing_messages, refusing_sync, \
    tolerant
from engine.stray_cancels import end_stray_cancel, is_stray_cancel

# (request streaming, response streaming) -> the handler's behavior and its constructor.
_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}


def _async_guarded(behavior: Callable, method: str, request_streaming: bool,
                   parses: bool) -> Callable:
    async def admitted(request, context):
        """What the service is handed: the request, or the client stream's messages."""
        if not parses:
            return request
        if request_streaming:
            return refusing_messages(request, context)
        if isinstance(request, Malformed):
            await refuse(context, request)
        return request

    if inspect.isasyncgenfunction(behavior):
        async def stream(request, context):
            try:
                # Closed with this one, as grpc would have closed it (its finally frees blocks).
                async with contextlib.aclosing(
                        behavior(await admitted(request, context), context)) as responses:
                    async for response in responses:
                        yield response
            except asyncio.CancelledError as e:
                if not is_stray_cancel(context, e):
                    raise
                await end_stray_cancel(context, method)
        return stream

    async def unary(request, context):
        try:
            return await behavior(await admitted(request, context), context)
        except asyncio.CancelledError as e:
            if not is_stray_cancel(context, e):
                raise
            await end_stray_cancel(context, method)
    return unary


def guarded(handler: grpc.RpcMethodHandler | None, method: str) -> grpc.RpcMethodHandler | None:
    """``handler`` in the module's wrapper. A method that takes raw bytes has nothing to parse;
    a synchronous one runs in gRPC's executor, where no CancelledError comes, and only one that
    takes a single message can be given its refusal."""
    if handler is None:
        return None
    request_streaming = bool(handler.request_streaming)
    attr, make = _KINDS[(request_streaming, bool(handler.response_streaming))]
    behavior = getattr(handler, attr)
    deserializer = handler.request_deserializer
    if inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior):
        behavior = _async_guarded(behavior, method, request_streaming, deserializer is not None)
    elif deserializer is not None and not request_streaming:
        behavior = refusing_sync(behavior, bool(handler.response_streaming))
    else:
        return handler
    return make(behavior, request_deserializer=tolerant(deserializer),
                response_serializer=handler.response_serializer)


class HandlerGuardInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self) -> None:
        # method -> (the service's handler, its wrapper): wrapped once, not on every call.
        self._wrapped: dict[str, tuple] = {}

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        known = self._wrapped.get(details.method)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = guarded(handler, details.method)
        if handler is not None:
            self._wrapped[details.method] = (handler, wrapped)
        return wrapped
