"""API keys for the router's services: ``--api-key`` (or ``PDSERVE_API_KEY``).

Callers of ``Router`` and ``RouterAdmin`` send ``authorization: Bearer <key>`` metadata (the
SDK's ``api_key=``); a call without it, or with another key, ends with UNAUTHENTICATED before
it reaches the service. The health and reflection services stay open, so load balancers and
orchestrators can probe the router without the key. Keys are compared in constant time. With
``--tls-cert-file`` the key travels encrypted; without, only use it on a trusted network.
"""
from __future__ import annotations

import hmac

import grpc

from client.channels import check_api_key
from engine.call_abort import abort_call

PROTECTED_PREFIXES = ("/pdserve.v1.Router/", "/pdserve.v1.RouterAdmin/")


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        check_api_key(api_key)
        self._expected = f"Bearer {api_key}".encode()
        self._deny = _deny_handlers()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not details.method.startswith(PROTECTED_PREFIXES):
            return await continuation(details)
        given = next((v for k, v in (details.invocation_metadata or ())
                      if k == "authorization"), "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(given, self._expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return self._deny["stream" if handler.response_streaming else "unary"]


def _deny_handlers() -> dict[str, grpc.RpcMethodHandler]:
    message = "a valid API key is required (authorization: Bearer <key>)"

    async def unary(request, context):
        await abort_call(context, grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await abort_call(context, grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a server-streaming handler is

    return {"unary": grpc.unary_unary_rpc_method_handler(unary),
            "stream": grpc.unary_stream_rpc_method_handler(stream)}
