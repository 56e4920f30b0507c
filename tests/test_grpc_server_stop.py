"""A service's stop is bounded (engine/grpc_server.py): a shutdown step that never ends does not
keep the process up until its supervisor's SIGKILL; the stuck coroutine's stack is logged. A
service whose launcher died stops on its own (``parent_fd``). One told to stop while it starts
exits 0 without serving."""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine import grpc_server
from engine.grpc_server import GrpcServer, ServerConfig, serve
from tests.proc_signals import reap, wait_until

ROOT = Path(__file__).resolve().parent.parent
_FAULTS_DIR = str(ROOT / "tests" / "engine_faults")


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


def test_a_service_stops_when_its_launcher_is_gone():
    # The launcher holds the pipe's only write end: its end of file is the launcher's death.
    read_fd, write_fd = os.pipe()

    async def run() -> bool:
        server = GrpcServer(ServerConfig(drain_timeout_s=0.1, grace_s=0.1, parent_fd=read_fd),
                            [])
        loop = asyncio.get_running_loop()
        loop.call_later(0.3, os.close, write_fd)
        # SIGTERM's effect, should the pipe go unnoticed; serve then still returns.
        fallback = loop.call_later(20.0, server.stopping.set)
        await serve(server, lambda: 0)
        fallback.cancel()
        return fallback.when() > loop.time()

    assert asyncio.run(run())  # stopped by the pipe, well before the fallback
    with pytest.raises(OSError):  # the service closed its end
        os.fstat(read_fd)


def test_a_launcher_writing_to_the_pipe_does_not_stop_the_service():
    read_fd, write_fd = os.pipe()

    async def run() -> bool:
        server = GrpcServer(ServerConfig(drain_timeout_s=0.1, grace_s=0.1, parent_fd=read_fd),
                            [])
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, os.write, write_fd, b"x")
        stopped_early = []
        loop.call_later(0.6, lambda: stopped_early.append(server.stopping.is_set()))
        loop.call_later(0.7, server.stopping.set)
        await serve(server, lambda: 0)
        return stopped_early == [False]

    try:
        assert asyncio.run(run())
    finally:
        os.close(write_fd)
        os.close(read_fd)  # still open: the service stopped for another reason


@pytest.mark.parametrize("fd", [-1, True, "3"])
def test_a_bad_parent_fd_is_refused(fd):
    with pytest.raises(ValueError, match="parent_fd must be a file descriptor"):
        ServerConfig(parent_fd=fd)


def test_health_says_serving_only_once_the_services_start_is_done():
    """SERVING was set as the server listened, before on_started (a worker's Redis
    registration and KV handles): a health check then sent it work its start had not readied."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    service = "pdserve.test.Thing"

    async def status(server: GrpcServer) -> str:
        async with grpc.aio.insecure_channel(server.address) as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=10)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    async def run() -> list[str]:
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=0.1,
                                         grace_s=0.1), [service])
        seen = []

        async def on_started() -> None:
            seen.append(await status(server))

        async def watch() -> None:
            while len(seen) < 2:
                await asyncio.sleep(0.01)
                if len(seen) == 1 and await status(server) == "SERVING":
                    seen.append("SERVING")
            server.stopping.set()

        watcher = asyncio.ensure_future(watch())
        await serve(server, lambda: 0, on_started=on_started)
        await watcher
        return seen

    assert asyncio.run(run()) == ["NOT_SERVING", "SERVING"]


def test_a_health_watch_ends_with_the_stop_not_at_the_grace_periods_end():
    """grpc's health servicer keeps a Watch open for the server's life, and the drain counts
    no such stream: every stop waited out the whole grace for a client that watches, then cut
    it. It gets NOT_SERVING, and its stream ends OK."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    async def run():
        server = GrpcServer(ServerConfig(host="127.0.0.1", port=0, drain_timeout_s=0.1,
                                         grace_s=60.0), ["pdserve.test.Thing"])
        seen = []

        async def watch() -> None:
            async with grpc.aio.insecure_channel(server.address) as ch:
                call = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest())
                async for resp in call:
                    seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status))
                    if len(seen) == 1:
                        server.stopping.set()  # SIGTERM while it watches
                seen.append((await call.code()).name)

        async def started() -> None:
            watcher.append(asyncio.ensure_future(watch()))

        watcher = []
        # Bounded far below the grace: a watch the stop waited for would take it all.
        async with asyncio.timeout(30):
            await serve(server, lambda: 0, on_started=started)
            await watcher[0]
        return seen

    assert asyncio.run(run()) == ["SERVING", "NOT_SERVING", "OK"]


def test_a_stop_asked_before_serve_never_serves(monkeypatch):
    """A SIGTERM the process recorded before its service could take it (a router setting up,
    a worker loading its model): serve returns without listening or starting the service."""
    asked = threading.Event()
    asked.set()
    monkeypatch.setattr(grpc_server, "stop_asked", asked)
    started = []

    async def run() -> None:
        server = GrpcServer(ServerConfig(drain_timeout_s=0.1, grace_s=0.1), [])

        async def on_started() -> None:
            started.append(True)

        async with asyncio.timeout(30):
            await serve(server, lambda: 0, on_started=on_started)

    asyncio.run(run())
    assert started == []


@pytest.mark.timeout(240)
def test_a_worker_told_to_stop_while_it_loads_exits_0_without_serving(tmp_path):
    """SIGTERM while the model loads (an operator's stop, a rolling restart): the worker died
    by the signal's default action, status -15, which ``pdserve up``'s supervisor took for a
    crash, starting it again against --max-restarts. It exits 0 once the load is done. The
    load here lasts until the worker has seen the signal (tests/engine_faults)."""
    marker = tmp_path / "loading"
    # This checkout's modules for the fault too: it imports them before the worker's own.
    env = dict(os.environ, PDSERVE_TEST_FAULT=f"load_until_stopped:{marker}",
               PYTHONPATH=os.pathsep.join(
                   p for p in (_FAULTS_DIR, str(ROOT), os.environ.get("PYTHONPATH")) if p))
    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "decode", "--model", "micro-llama", "--port", "0",
         "--num-gpu-blocks", "16", "--ready-fd", str(write_fd)],
        cwd=ROOT, env=env, pass_fds=(write_fd,), stderr=subprocess.PIPE, text=True)
    os.close(write_fd)
    try:
        assert wait_until(lambda: marker.exists() or worker.poll() is not None, 120)
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=120)
    finally:
        reap(worker)
    with os.fdopen(read_fd) as ready:
        assert ready.read() == ""  # never reported an address: it never served
    assert worker.returncode == 0, err[-3000:]
    assert "decode worker: stopped while loading its model; exiting without serving" in err
