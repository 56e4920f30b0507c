"""API keys for the router's services: ``--api-key`` (or ``PDSERVE_API_KEY``) and, for the
admin service alone, ``--admin-api-key`` (or ``PDSERVE_ADMIN_API_KEY``).

Callers send ``authorization: Bearer <key>`` metadata (the SDK's ``api_key=``); a call without
it, or with another key, ends with UNAUTHENTICATED before it reaches the service. ``Router``
takes the API key; ``RouterAdmin`` (drain workers, cancel any request, reset caches) the admin
key when one is set, so that a client allowed to generate is not allowed to operate the
cluster; without an admin key it takes the API key, as ``Router`` does. The health and
reflection services stay open, so load balancers and orchestrators can probe the router
without a key. Keys are compared in constant time. With ``--tls-cert-file`` the key travels
encrypted; without, only use it on a trusted network.
"""
from __future__ import annotations

import hmac

import grpc

from client.channels import check_api_key
from engine.call_abort import abort_call

ROUTER_PREFIX = "/pdserve.v1.Router/"
ADMIN_PREFIX = "/pdserve.v1.RouterAdmin/"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str | None, admin_api_key: str | None = None) -> None:
        """``api_key`` guards Router, and RouterAdmin unless ``admin_api_key`` is given (None:
        that service is open). At least one key."""
        if api_key is None and admin_api_key is None:
            raise ValueError("an API key interceptor needs api_key or admin_api_key")
        check_api_key(api_key)
        check_api_key(admin_api_key)
        admin = admin_api_key if admin_api_key is not None else api_key
        self._expected = {ROUTER_PREFIX: _bearer(api_key), ADMIN_PREFIX: _bearer(admin)}
        self._deny = _deny_handlers()

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        expected = next((key for prefix, key in self._expected.items()
                         if details.method.startswith(prefix)), None)
        if expected is None:  # health, reflection, or a service without a key
            return await continuation(details)
        given = next((v for k, v in (details.invocation_metadata or ())
                      if k == "authorization"), "")
        if isinstance(given, str):
            given = given.encode()
        if hmac.compare_digest(_scheme_folded(given), expected):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        return self._deny["stream" if handler.response_streaming else "unary"]


def _bearer(key: str | None) -> bytes | None:
    return None if key is None else f"Bearer {key}".encode()


def _scheme_folded(given: bytes) -> bytes:
    """An authorization scheme is case-insensitive (RFC 7235): ``bearer <key>``, as some
    clients and proxies send it, is the same credential. The key itself stays exact."""
    if given[:7].lower() == b"bearer ":
        return b"Bearer " + given[7:]
    return given


def _deny_handlers() -> dict[str, grpc.RpcMethodHandler]:
    message = "a valid API key is required (authorization: Bearer <key>)"

    async def unary(request, context):
        await abort_call(context, grpc.StatusCode.UNAUTHENTICATED, message)

    async def stream(request, context):
        await abort_call(context, grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # an async generator, as a server-streaming handler is

    return {"unary": grpc.unary_unary_rpc_method_handler(unary),
            "stream": grpc.unary_stream_rpc_method_handler(stream)}
