"""Health checks of the peers a caller has calls on: how a peer that hangs is found in seconds.

A server that hangs without closing its connections (a stopped or wedged process, a host gone
from the network) holds every call on it until the call's deadline. gRPC's keepalive pings cut
such a connection (client/keepalive.py), but they are answered by gRPC's own threads, so a peer
whose event loop is stuck still answers them, and their timeout is kept long (20 s) to let this
watch, which also bars the peer from new calls, come first. So a caller asks each peer it has
calls on for its health (the standard ``grpc.health.v1`` Check) every ``interval_s``, and
takes one that leaves ``misses`` checks in a row unanswered as hung: it cuts the calls on it,
which then fail with UNAVAILABLE and go on elsewhere (the SDK's failover, the router's
migration).

A health check is answered by the server's event loop, not by its engine, so a peer deep in a
long prefill answers at once; a draining one answers NOT_SERVING, which counts as an answer.
Peers without calls are not checked: nothing waits on them.

The same watch serves the router, which checks its workers (router/liveness.py), and the SDK,
which checks its routers: the asyncio client from a task, the blocking one from a thread.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from client.errors import CLIENT_CLOSED, CancelledError

logger = logging.getLogger(__name__)

_MISSED = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)


def check_health_checks(interval_s, misses) -> None:
    """Validates a health-check interval (0: off) and miss count."""
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) \
            or not (interval_s == 0 or 0.05 <= interval_s <= 3600):
        raise ValueError("health-check interval must be 0 (off) or seconds in [0.05, 3600], "
                         f"got {interval_s!r}")
    if isinstance(misses, bool) or not isinstance(misses, int) or not 1 <= misses <= 100:
        raise ValueError(f"health-check misses must be an integer in [1, 100], got {misses!r}")


def rpc_error(code: grpc.StatusCode, details: str,
              trailing_metadata: tuple = ()) -> grpc.aio.AioRpcError:
    """The error a call ending with ``code`` (and ``trailing_metadata``) raises."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing_metadata),
                                details=details)


class Cut:
    """One watched call: why it was cut, once it was."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason: str | None = None

    def error(self) -> grpc.aio.AioRpcError:
        return rpc_error(grpc.StatusCode.UNAVAILABLE, self.reason or "the peer hung")


class WatchedCalls:
    """The calls in flight to one peer, each with how to cut it. Thread-safe: the blocking
    client's checks run in a thread of their own."""

    def __init__(self) -> None:
        self._calls: dict[int, tuple[Cut, Callable[[str], object]]] = {}
        self._keys = itertools.count()
        self._lock = threading.Lock()
        self.misses = 0  # health checks in a row left unanswered

    def __len__(self) -> int:
        return len(self._calls)

    def add(self, cut_call: Callable[[str], object]) -> tuple[int, Cut]:
        key, cut = next(self._keys), Cut()
        with self._lock:
            if not self._calls:
                # An idle peer is not checked: misses left from its last busy spell are not
                # "in a row" with the next one's, which would be cut after a single miss.
                self.misses = 0
            self._calls[key] = (cut, cut_call)
        return key, cut

    def remove(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    @contextmanager
    def watch(self, call):
        """Watches a gRPC call or future (``cancel()`` cuts it) while the block runs."""
        key, cut = self.add(lambda _reason: call.cancel())
        try:
            yield cut
        finally:
            self.remove(key)

    def cut_all(self, reason: str) -> int:
        with self._lock:
            calls, self._calls = list(self._calls.values()), {}
        for cut, cut_call in calls:
            cut.reason = reason
            cut_call(reason)
        return len(calls)

    def answered(self, error: grpc.RpcError | None, misses: int, interval_s: float) -> str | None:
        """Notes one check's outcome; the reason to cut when it was the last miss allowed."""
        if error is None or error.code() not in _MISSED:
            self.misses = 0  # any status is an answer: the peer's event loop runs
            return None
        self.misses += 1
        if self.misses < misses:
            return None
        self.misses = 0
        return (f"no answer to {misses} health checks in a row ({misses * interval_s:g} s; "
                f"last: {error.code().name})")


@dataclass(eq=False)
class Peer:
    """A server the caller has a channel to, and the calls on it."""

    address: str
    channel: object  # grpc.Channel or grpc.aio.Channel
    calls: WatchedCalls = field(default_factory=lambda: WatchedCalls())


def cut_router(router: Peer, reason: str) -> None:
    """The SDK's answer to a hung router: its calls are cut, and fail over."""
    n = router.calls.cut_all(f"router {router.address} hung: {reason}")
    logger.warning("router %s hung (%s): %d call(s) on it cut, to fail over", router.address,
                   reason, n)


async def watched_unary(calls: WatchedCalls, call):
    """``await call``; a cut call raises UNAVAILABLE (a locally cancelled call would raise
    CancelledError, which reads as the caller's own cancellation)."""
    with calls.watch(call) as cut:
        try:
            return await call
        except asyncio.CancelledError:
            if cut.reason is None or _cancelling():
                _raise_local_cancel()
    raise cut.error()


async def watched_stream(calls: WatchedCalls, call) -> AsyncIterator:
    """The messages of a server-streaming ``call``; a cut call raises UNAVAILABLE. Leaving
    early cancels the call."""
    with calls.watch(call) as cut:
        try:
            async for msg in call:
                yield msg
            return
        except asyncio.CancelledError:
            if cut.reason is None or _cancelling():
                _raise_local_cancel()
        finally:
            call.cancel()  # no-op when finished; otherwise the peer aborts the request
    raise cut.error()


def _cancelling() -> bool:
    """Whether the running task was cancelled: the caller's cancel (or its asyncio.timeout)
    landing with a cut of its call is still the caller's, not a failure to fail over."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _raise_local_cancel() -> None:
    """In an ``except asyncio.CancelledError``: the caller's own cancellation goes on as is;
    a call cancelled under a task nobody cancelled (its channel closed: ``AsyncClient.close``
    from another task) fails with the SDK's CancelledError, as the blocking client's does, so
    the task does not end as if it had been cancelled itself."""
    if asyncio.current_task() is None or _cancelling():
        raise  # noqa: PLE0704 - re-raises the CancelledError being handled
    raise CancelledError(CLIENT_CLOSED) from None


async def check_loop(interval_s: float, misses: int, busy: Callable[[], list],
                     on_hung: Callable[[object, str], None]) -> None:
    """Every ``interval_s``, checks the peers ``busy()`` returns (objects with a ``channel``,
    an aio channel, and ``calls``), and calls ``on_hung(peer, reason)`` for each that left
    ``misses`` checks in a row unanswered."""
    loop = asyncio.get_running_loop()

    async def check(peer) -> None:
        error = None
        try:
            await health_pb2_grpc.HealthStub(peer.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=interval_s)
        except grpc.aio.AioRpcError as e:
            error = e
        except grpc.aio.UsageError:
            return  # its channel was closed under the check: nothing learnt of the peer
        reason = peer.calls.answered(error, misses, interval_s)
        if reason is not None:
            on_hung(peer, reason)

    while True:
        start = loop.time()
        peers = busy()
        if peers:
            await asyncio.gather(*(check(p) for p in peers))
        await asyncio.sleep(max(interval_s - (loop.time() - start), 0.0))


class CheckThread(threading.Thread):
    """``check_loop`` for blocking channels, in a daemon thread until ``stop()``."""

    def __init__(self, interval_s: float, misses: int, peers: list,
                 on_hung: Callable[[object, str], None]) -> None:
        super().__init__(name="pdserve-health-checks", daemon=True)
        self.interval_s, self.misses = interval_s, misses
        self.peers, self.on_hung = peers, on_hung
        self._stopped = threading.Event()

    def run(self) -> None:
        took = 0.0
        while not self._stopped.wait(max(self.interval_s - took, 0.0)):
            start = time.monotonic()
            try:
                self._check_all()
            except ValueError:  # a channel closed under the thread: the client is closing
                return
            took = time.monotonic() - start

    def _check_all(self) -> None:
        # Every busy peer's check goes out at once; each waits at most interval_s.
        checks = [(p, health_pb2_grpc.HealthStub(p.channel).Check.future(
            health_pb2.HealthCheckRequest(), timeout=self.interval_s))
            for p in self.peers if len(p.calls)]
        for peer, fut in checks:
            error = fut.exception()
            reason = peer.calls.answered(error, self.misses, self.interval_s)
            if reason is not None:
                self.on_hung(peer, reason)

    def stop(self) -> None:
        self._stopped.set()
