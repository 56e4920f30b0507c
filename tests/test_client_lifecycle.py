"""The SDK's clients over their life: a call interrupted by the caller (Ctrl-C), close() from
another thread or task while a call waits to fail over, a client inherited by a forked child,
and one AsyncClient's first calls from two event loops at once. Real gRPC servers on
loopback; a servicer that records what the router saw (a call cancelled, or still held)."""
from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

import client.async_client as async_client
import client.sync_client as sync_client
from client import AsyncClient, CancelledError, Client, FailoverPolicy
from client.failover import Attempts
from protos import router_pb2, router_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
# Waits that end at once when the SDK behaves, and only at their bound when it does not: a
# regression fails after the bound instead of passing slowly.
BOUND_S = 10.0
# A failover backoff that no test waits out: only close() ends it.
LONG_BACKOFF = FailoverPolicy(backoff_s=60.0, max_backoff_s=60.0, health_check_interval_s=0)


class _Recorder(router_pb2_grpc.RouterServicer):
    """Holds every Complete and Generate until the caller cancels it (recorded), or fails
    them with UNAVAILABLE at once (``unavailable``)."""

    def __init__(self, unavailable: bool = False) -> None:
        self.unavailable = unavailable
        self.started = threading.Event()
        self.cancelled = threading.Event()

    def _hold(self, context) -> None:
        self.started.set()
        if self.unavailable:
            context.abort(grpc.StatusCode.UNAVAILABLE, "no worker")
        deadline = time.monotonic() + 60
        while context.is_active() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not context.is_active():
            self.cancelled.set()

    def Complete(self, request, context):
        self._hold(context)
        return router_pb2.CompleteResponse(request_id="r", token_ids=[1], finish_reason="length")

    def Generate(self, request, context):
        yield router_pb2.GenerateChunk(request_id="r", token_ids=[1])
        self._hold(context)

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model="m", vocab_size=100, max_model_len=64)


@pytest.fixture
def serve():
    """Starts a router with the servicer given; its address."""
    servers = []

    def start(servicer) -> str:
        # A router's ping policy (engine/grpc_server.py): a default server answers the SDK's
        # keepalive pings of an idle channel with GOAWAY (too_many_pings) after ~20 s, on a
        # loaded machine while a forking test ran; gRPC busy at fork() can hang the child.
        servers.append(grpc.server(ThreadPoolExecutor(8), options=[
            ("grpc.http2.min_recv_ping_interval_without_data_ms", 0),
            ("grpc.http2.max_ping_strikes", 0)]))
        router_pb2_grpc.add_RouterServicer_to_server(servicer, servers[-1])
        port = servers[-1].add_insecure_port("127.0.0.1:0")
        servers[-1].start()
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(None)


def _child(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)  # gRPC's own log lines: apart


# Ctrl-C during complete(), the KeyboardInterrupt kept (as a REPL keeps sys.last_traceback).
# WAITING: the call is the SDK's to cancel (watched). Before that, on an idle channel, gRPC
# starts its polling thread after the call went out: a Ctrl-C there leaves the SDK no handle.
_INTERRUPTED = """
import sys
from client import Client, FailoverPolicy
from client.liveness import WatchedCalls
add = WatchedCalls.add
WatchedCalls.add = lambda *a: (print("WAITING", flush=True), add(*a))[1]
c = Client(sys.argv[1], timeout=60, failover=FailoverPolicy(health_check_interval_s=0))
try:
    c.complete([1, 2], max_tokens=100000)
except KeyboardInterrupt as e:
    held = e
    print("INTERRUPTED", flush=True)
sys.stdin.read()  # alive, the traceback held, until the test is done
"""


def test_ctrl_c_during_complete_cancels_the_call_on_the_router(serve):
    router = _Recorder()
    proc = _child(_INTERRUPTED, serve(router))
    try:
        assert proc.stdout.readline().strip() == "WAITING"
        assert router.started.wait(BOUND_S)
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "INTERRUPTED"
        # Without the cancel the router holds the call while the exception is kept.
        assert router.cancelled.wait(BOUND_S)
    finally:
        proc.kill()
        proc.communicate()


# Forks with a stream open. One child exits (atexit runs the Client's finalizer); another uses
# the inherited client and stream. Each dumps its stacks and exits 1 if it hangs.
_FORKED = """
import faulthandler, os, sys
from client import Client, FailoverPolicy
c = Client(sys.argv[1], timeout=60, failover=FailoverPolicy(health_check_interval_s=0.5))
stream = c.generate([1]); next(stream)

def child(use):
    if os.fork():
        return
    faulthandler.dump_traceback_later(10, exit=True)
    if use:
        for call in (lambda: c.complete([1]), lambda: next(stream)):
            try:
                call()
            except RuntimeError as e:
                print("child:", e, flush=True)
    sys.exit(0)

for use in (False, True):
    child(use)
    print("exit status", os.waitstatus_to_exitcode(os.wait()[1]), flush=True)
stream.close()
c.close()
print("parent closed", flush=True)
"""


def test_a_forked_child_neither_hangs_on_nor_uses_the_parents_client(serve):
    proc = _child(_FORKED, serve(_Recorder()))
    out, err = proc.communicate(timeout=60)
    made_before_fork = ("child: this Client was made before fork(); make a new one in the "
                        "child process")
    assert out.splitlines() == ["exit status 0", made_before_fork, made_before_fork,
                                "exit status 0", "parent closed"], out + err


# The same for an AsyncClient forked inside its event loop.
_FORKED_ASYNC = """
import asyncio, faulthandler, os, sys
from client import AsyncClient

async def main():
    ac = AsyncClient(sys.argv[1], timeout=60)
    await ac.model_info()
    if os.fork() == 0:
        faulthandler.dump_traceback_later(10, exit=True)
        try:
            await ac.model_info()
        except RuntimeError as e:
            print("child:", e, flush=True)
        await ac.close()
        os._exit(0)
    print("exit status", os.waitstatus_to_exitcode(os.wait()[1]), flush=True)
    print("parent", (await ac.model_info()).model, flush=True)
    await ac.close()

asyncio.run(main())
"""


def test_a_forked_child_cannot_use_the_parents_async_client(serve):
    proc = _child(_FORKED_ASYNC, serve(_Recorder()))
    out, err = proc.communicate(timeout=60)
    assert out.splitlines() == ["child: this AsyncClient was made before fork(); make a new "
                                "one in the child process", "exit status 0", "parent m"], \
        out + err


@pytest.fixture
def backing_off(monkeypatch):
    """An event set once a call has given up on an attempt and is about to wait its backoff."""
    entered = threading.Event()
    after = Attempts.after

    def noting(self, error):
        delay = after(self, error)
        entered.set()
        return delay

    monkeypatch.setattr(Attempts, "after", noting)
    return entered


_BLOCKING_CALLS = {"generate": lambda c: list(c.generate([1])),
                   "complete": lambda c: c.complete([1])}


def _call_in_thread(c: Client, call: str) -> tuple[threading.Thread, list[Exception]]:
    """Runs one of _BLOCKING_CALLS on ``c`` in a thread; what it raised lands in the list."""
    got: list[Exception] = []

    def read():
        try:
            _BLOCKING_CALLS[call](c)
        except Exception as e:  # noqa: BLE001 - what the caller sees is the point
            got.append(e)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return reader, got


@pytest.mark.parametrize("call", sorted(_BLOCKING_CALLS))
def test_close_from_another_thread_ends_a_blocking_calls_backoff(serve, backing_off, call):
    c = Client(serve(_Recorder(unavailable=True)), timeout=600, failover=LONG_BACKOFF)
    reader, got = _call_in_thread(c, call)
    assert backing_off.wait(BOUND_S)
    c.close()
    reader.join(BOUND_S)  # a 60 s backoff: ends in time only if close() woke it
    assert not reader.is_alive()
    assert [type(e) for e in got] == [RuntimeError] and "this Client is closed" in str(got[0])


@pytest.mark.parametrize("call", sorted(_BLOCKING_CALLS))
def test_close_just_before_the_rpc_starts_raises_the_sdks_error(serve, monkeypatch, call):
    # close() from another thread landing between the closed check and the stub's call:
    # attempt_request runs in that window.
    c = Client(serve(_Recorder()), timeout=60, failover=LONG_BACKOFF)
    request = sync_client.attempt_request

    def closing(*args):
        c.close()
        return request(*args)

    monkeypatch.setattr(sync_client, "attempt_request", closing)
    with pytest.raises(RuntimeError, match="this Client is closed"):
        _BLOCKING_CALLS[call](c)  # not gRPC's ValueError: Cannot invoke RPC: Channel closed!


def _health_checks() -> list[asyncio.Task]:
    return [t for t in asyncio.all_tasks() if not t.done()
            and getattr(t.get_coro(), "__qualname__", "") == "check_loop"]


async def _drain(ac: AsyncClient, call: str) -> None:
    if call == "generate":
        async for _ in ac.generate([1]):
            pass
    else:
        await ac.complete([1])


@pytest.mark.parametrize("call", ["generate", "complete"])
def test_async_close_ends_a_calls_backoff(serve, backing_off, call):
    checked = FailoverPolicy(backoff_s=60.0, max_backoff_s=60.0, health_check_interval_s=0.2)

    async def run():
        ac = AsyncClient(serve(_Recorder(unavailable=True)), timeout=600, failover=checked)
        task = asyncio.create_task(_drain(ac, call))
        while not backing_off.is_set():
            await asyncio.sleep(0.01)
        await ac.close()
        await asyncio.wait({task}, timeout=BOUND_S)  # a 60 s backoff: only close() ends it
        assert task.done()
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            task.result()
        return _health_checks()

    assert asyncio.run(run()) == []  # no health checks started again after the close


def test_first_calls_from_two_loops_open_one_set_of_channels(serve, monkeypatch):
    ac = AsyncClient(serve(_Recorder()), timeout=60)
    opened, inside, go_on = [], threading.Event(), threading.Event()
    real = async_client.open_channels

    def slow_open(*args, **kwargs):  # holds the first loop between its check and its set
        opened.append(1)
        inside.set()
        go_on.wait(BOUND_S)
        return real(*args, **kwargs)

    monkeypatch.setattr(async_client, "open_channels", slow_open)
    results: dict[str, object] = {}

    async def first():
        results["first"] = (await ac.model_info()).model
        await ac.close()

    async def second():
        try:
            results["second"] = (await ac.model_info()).model
        except RuntimeError as e:
            results["second"] = e

    threads = [threading.Thread(target=asyncio.run, args=(coro(),), daemon=True)
               for coro in (first, second)]
    threads[0].start()
    assert inside.wait(BOUND_S)
    threads[1].start()
    threads[1].join(1.0)  # let in, it would open channels of its own meanwhile
    go_on.set()
    for t in threads:
        t.join(BOUND_S)
    assert opened == [1]
    assert results["first"] == "m" and isinstance(results["second"], RuntimeError)


def _close_from_another_thread(ac: AsyncClient) -> None:
    t = threading.Thread(target=asyncio.run, args=(ac.close(),))
    t.start()
    t.join(BOUND_S)


@pytest.mark.parametrize("call", ["generate", "complete"])
def test_async_close_just_before_the_rpc_starts_raises_the_sdks_error(serve, monkeypatch, call):
    """As the blocking client's: close() from another thread between the closed check and
    the stub's call raised grpc's UsageError."""
    ac = AsyncClient(serve(_Recorder()), timeout=60, failover=LONG_BACKOFF)
    request, armed = async_client.attempt_request, []

    def closing(*args):
        if armed:
            _close_from_another_thread(ac)
        return request(*args)

    monkeypatch.setattr(async_client, "attempt_request", closing)
    # The loop is held in ``closing`` while close() waits for it: that wait's bound (5 s)
    # would be this test's time, and it changes nothing checked here.
    monkeypatch.setattr(async_client, "_FOREIGN_CLOSE_S", 0.2)

    async def run():
        await ac.model_info()  # the channels are open, on this loop
        armed.append(1)
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            await _drain(ac, call)

    asyncio.run(run())


def test_close_ends_a_wait_ready_at_once(serve):
    """A router not up yet: close() from another task or thread ends wait_ready with the
    SDK's error (the async one raised grpc's UsageError; the blocking one waited out its
    whole timeout, then said the router was not reachable)."""
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{s.getsockname()[1]}"

    async def run():
        ac = AsyncClient(nowhere)
        waiting = asyncio.create_task(ac.wait_ready(timeout=2 * BOUND_S))
        await asyncio.sleep(0.3)
        await ac.close()
        await asyncio.wait({waiting}, timeout=BOUND_S)
        with pytest.raises(RuntimeError, match="this AsyncClient is closed"):
            waiting.result()

    asyncio.run(run())
    c = Client(nowhere)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.wait_ready, 2 * BOUND_S)
        time.sleep(0.3)
        c.close()
        with pytest.raises(RuntimeError, match="this Client is closed"):
            waiting.result(BOUND_S)


def test_async_close_from_another_thread_stops_the_checks_on_their_own_loop(serve):
    """The health checks' task is cancelled on its loop's thread: cancelled from the closing
    thread, asyncio's debug mode refused it and close() failed before closing a channel."""
    checked = FailoverPolicy(health_check_interval_s=0.1, keepalive_time_s=None)
    recorder = _Recorder()
    ac = AsyncClient(serve(recorder), timeout=60, failover=checked)

    async def run():
        asyncio.get_running_loop().set_debug(True)
        task = asyncio.create_task(_drain(ac, "complete"))
        # The call must have reached the router before the close, or it has nothing to cancel
        # (the checks start with the channels, before the call is sent).
        while not (_health_checks() and recorder.started.is_set()):
            await asyncio.sleep(0.01)
        closer = threading.Thread(target=asyncio.run, args=(ac.close(),))
        closer.start()
        while closer.is_alive():
            await asyncio.sleep(0.01)
        await asyncio.wait({task}, timeout=BOUND_S)
        assert task.done()
        for _ in range(100):
            if not _health_checks():
                break
            await asyncio.sleep(0.01)
        return _health_checks()

    assert asyncio.run(run()) == []
    assert recorder.cancelled.wait(BOUND_S)  # the channel closed: the router saw the cancel


@pytest.mark.parametrize("call", sorted(_BLOCKING_CALLS))
def test_close_from_another_thread_cancels_a_call_in_flight_with_the_sdks_message(serve, call):
    """As AsyncClient's: not gRPC's 'Stream removed (Channel closed!)', which reads as a
    network fault rather than the caller's own close()."""
    recorder = _Recorder()
    c = Client(serve(recorder), timeout=60, failover=LONG_BACKOFF)
    reader, got = _call_in_thread(c, call)
    assert recorder.started.wait(BOUND_S)
    c.close()
    reader.join(BOUND_S)
    assert not reader.is_alive()
    assert [type(e) for e in got] == [CancelledError], got
    assert str(got[0]) == "the call was cancelled: its client was closed"
