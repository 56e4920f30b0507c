"""Keepalive pings for gRPC connections: how one end finds a peer that hangs.

A peer that stops answering but keeps its connections open (a stopped process, a host gone
without closing its sockets) would hold every call on the connection until its deadline.
With these options the connection's owner pings the peer every ``time_s`` and closes the
connection when a ping goes unanswered for ``timeout_s``; its calls then fail with UNAVAILABLE
(the SDK fails them over, client/failover.py; the router migrates them, router/migration.py),
or, on a server, are cancelled. gRPC core (1.85) does not time a keepalive ping by
``keepalive_timeout_ms`` but by its ping timeout, ``grpc.http2.ping_timeout_ms``, one minute
by default (grpc/grpc#39239): without it set as well, a hung peer was measured to be cut only
after ~60 s. pdserve's servers accept pings at any rate (engine/grpc_server.py), as the defaults
would answer them with GOAWAY.
"""
from __future__ import annotations


def keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    timeout_ms = max(int(timeout_s * 1000), 1)
    return [("grpc.keepalive_time_ms", max(int(time_s * 1000), 1)),
            ("grpc.keepalive_timeout_ms", timeout_ms),
            ("grpc.http2.ping_timeout_ms", timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # Pings go on while the peer sends nothing, as a hung one does.
            ("grpc.http2.max_pings_without_data", 0)]


def check_keepalive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.001 <= value <= 3600:
        raise ValueError(f"{name} must be a number of seconds in [0.001, 3600], got {value!r}")
