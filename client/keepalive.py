"""Keepalive pings for gRPC channels: how a caller finds a peer that hangs.

A peer that stops answering but keeps its connections open (a stopped process, a host gone
without closing its sockets) would hold every call on the connection until its deadline.
With these options the channel pings the peer every ``time_s`` and closes the connection when
a ping goes unanswered for ``timeout_s``; its calls then fail with UNAVAILABLE, which the SDK
fails over (client/failover.py) and the router migrates (router/migration.py). pdserve's
servers accept pings at any rate (engine/grpc_server.py), as the defaults would answer them
with GOAWAY. With grpcio 1.85 the cut was measured to come only after ~60 s, gRPC's own ping
timeout, whatever ``timeout_s`` says; the health checks (client/liveness.py) find a hung peer
in seconds, and these pings stay as a second line.
"""
from __future__ import annotations


def keepalive_options(time_s: float, timeout_s: float) -> list[tuple[str, int]]:
    return [("grpc.keepalive_time_ms", max(int(time_s * 1000), 1)),
            ("grpc.keepalive_timeout_ms", max(int(timeout_s * 1000), 1)),
            ("grpc.keepalive_permit_without_calls", 1),
            # Pings go on while the peer sends nothing, as a hung one does.
            ("grpc.http2.max_pings_without_data", 0)]


def check_keepalive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not 0.001 <= value <= 3600:
        raise ValueError(f"{name} must be a number of seconds in [0.001, 3600], got {value!r}")
