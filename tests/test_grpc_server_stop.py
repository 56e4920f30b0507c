"""A service's stop is bounded (engine/grpc_server.py): a shutdown step that never ends does not
keep the process up until its supervisor's SIGKILL; the stuck coroutine's stack is logged."""
from __future__ import annotations

import asyncio
import logging

from engine import grpc_server
from engine.grpc_server import GrpcServer, ServerConfig, serve


def test_a_shutdown_step_that_never_ends_is_cut_after_drain_grace_and_slack(monkeypatch, caplog):
    monkeypatch.setattr(grpc_server, "STOP_SLACK_S", 0.3)

    async def stuck_presence_stop() -> None:
        await asyncio.Event().wait()  # e.g. a registry that never answers, unbounded

    async def run() -> float:
        server = GrpcServer(ServerConfig(drain_timeout_s=0.1, grace_s=0.1), [])
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, server.stopping.set)  # SIGTERM's effect
        start = loop.time()
        await serve(server, lambda: 0, on_stopping=stuck_presence_stop)
        return loop.time() - start

    with caplog.at_level(logging.ERROR, logger="engine.grpc_server"):
        asyncio.run(run())
    assert "has not stopped" in caplog.text
    # Where the stop was stuck: the chain of awaits down to the step that never ended.
    assert "pending: _bounded_stop.<locals>.stop" in caplog.text
    assert "-> test_a_shutdown_step_that_never_ends_is_cut_after_drain_grace_and_slack" \
           ".<locals>.stuck_presence_stop" in caplog.text


def test_a_normal_stop_logs_nothing_wrong(caplog):
    async def run() -> None:
        server = GrpcServer(ServerConfig(drain_timeout_s=0.1, grace_s=0.1), [])
        asyncio.get_running_loop().call_later(0.2, server.stopping.set)
        await serve(server, lambda: 0)

    with caplog.at_level(logging.ERROR, logger="engine.grpc_server"):
        asyncio.run(run())
    assert "has not stopped" not in caplog.text
