"""How the SDK connects to routers: plain or TLS channels (with the failover policy's
keepalive), and the API key each call carries."""
from __future__ import annotations

from collections.abc import Sequence

import grpc

from client.failover import FailoverPolicy
from protos.limits import message_size_options


def open_channels(addresses: Sequence[str], failover: FailoverPolicy, tls: bool,
                  root_certificates: bytes | None, aio: bool) -> list:
    """A channel per router. ``tls`` (implied by ``root_certificates``) verifies the router's
    certificate against ``root_certificates``, or the system's roots when None."""
    options = message_size_options() + failover.channel_options()
    mod = grpc.aio if aio else grpc
    check_root_certificates(root_certificates)
    if not (tls or root_certificates is not None):
        return [mod.insecure_channel(a, options=options) for a in addresses]
    creds = grpc.ssl_channel_credentials(root_certificates=root_certificates)
    return [mod.secure_channel(a, creds, options=options) for a in addresses]


def check_root_certificates(root_certificates: bytes | None) -> None:
    if root_certificates is not None and not isinstance(root_certificates, bytes):
        raise ValueError("root_certificates must be PEM bytes")


def check_api_key(key: str | None) -> None:
    """What both ends accept as an API key (None: no key)."""
    if key is None:
        return
    # gRPC sends it as a header value: ASCII only (others fail every call with INTERNAL).
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable() \
            or " " in key:
        raise ValueError("api_key must be a non-empty string of printable ASCII characters "
                         "without spaces")


def call_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata every call sends: the router's API key, when it has one."""
    check_api_key(api_key)
    return None if api_key is None else (("authorization", f"Bearer {api_key}"),)
