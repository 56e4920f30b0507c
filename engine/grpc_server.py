"""The lifecycle every pdserve gRPC service shares.

Register the services, the standard health service and reflection; start; on SIGTERM or SIGINT
report NOT_SERVING (so balancers and the router stop sending work), let requests in flight
finish for up to ``drain_timeout_s``, then stop with a grace period.
"""
from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from engine.engine_front import SHUTDOWN_TIMEOUT_S
from engine.gc_policy import freeze_startup_heap
from engine.handler_guards import HandlerGuardInterceptor
from engine.health import HealthServicer
from engine.process_exit import exit_process, exit_status, stop_asked
from engine.switch_interval import apply_switch_interval
from protos.limits import message_size_options

logger = logging.getLogger(__name__)

# gRPC binds with SO_REUSEPORT by default: a second server on a taken port binds without error
# and the kernel splits connections between the two. A port in use must fail instead.
# Callers ping every connection (client/keepalive.py) to find a peer that hangs without
# closing it; by default a server answers pings more often than every 5 minutes while it sends
# nothing (a long prefill, a stalled stream) with GOAWAY, which would fail every call on the
# connection. Pings are accepted at any rate, with or without calls.
_SERVER_OPTIONS = [("grpc.so_reuseport", 0),
                   ("grpc.http2.min_recv_ping_interval_without_data_ms", 0),
                   ("grpc.http2.max_ping_strikes", 0),
                   ("grpc.keepalive_permit_without_calls", 1)]



@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    # 0 picks a free port (see GrpcServer.port).
    port: int = 0
    # After SIGTERM: how long requests in flight may run before the server stops.
    drain_timeout_s: float = 30.0
    # server.stop() grace: RPCs still running then are cancelled.
    grace_s: float = 5.0
    # An inherited pipe to write "HOST:PORT\n" to once serving, then close: how a launcher
    # that passed port 0 learns the port (router.launcher). None: nobody is told.
    ready_fd: int | None = None
    # The read end of an inherited pipe whose write end only the launcher holds: its end of
    # file means the launcher is gone, however it died (SIGKILL, the OOM killer), and the
    # service stops as on SIGTERM rather than serve on, orphaned, holding its port, its cores
    # or its GPU and its Redis registration. None: the service outlives whoever started it.
    parent_fd: int | None = None
    # Serve Prometheus metrics at http://host:metrics_port/metrics (engine/metrics.py); 0 picks
    # a free port, None serves none.
    metrics_port: int | None = None
    # PEM files: with both, the port serves TLS (gRPC's own, so health and reflection too).
    tls_cert_file: str | None = None
    tls_key_file: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.port, int) or not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port!r}")
        if self.metrics_port is not None and (
                isinstance(self.metrics_port, bool) or not isinstance(self.metrics_port, int)
                or not 0 <= self.metrics_port <= 65535):
            raise ValueError(f"metrics_port must be in [0, 65535] or None, "
                             f"got {self.metrics_port!r}")
        for name in ("drain_timeout_s", "grace_s"):
            value = getattr(self, name)
            # NaN failed the stop at SIGTERM; inf drained for ever.
            if isinstance(value, bool) or not isinstance(value, (int, float)) \
                    or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        for name in ("ready_fd", "parent_fd"):
            fd = getattr(self, name)
            if fd is not None and (isinstance(fd, bool) or not isinstance(fd, int) or fd < 0):
                raise ValueError(f"{name} must be a file descriptor, got {fd!r}")

        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file")
        for f in (self.tls_cert_file, self.tls_key_file):
            if f is not None and not os.path.isfile(f):
                raise ValueError(f"TLS file {f!r} does not exist")

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        with open(self.tls_key_file, "rb") as k, open(self.tls_cert_file, "rb") as c:
            return grpc.ssl_server_credentials([(k.read(), c.read())])

    @property
    def bind_address(self) -> str:
        return f"{self.host}:{self.port}"


class GrpcServer:
    def __init__(self, config: ServerConfig, service_names: list[str],
                 interceptors: list | None = None,
                 options: list[tuple[str, int]] | None = None) -> None:
        """``options``: more channel arguments for every connection the server accepts (the
        router's keepalive pings to its clients), over the defaults where they name one."""
        self.config = config
        self.service_names = list(service_names)
        # Last, so a caller the others turn away (no API key) learns nothing of its message.
        interceptors = [*(interceptors or ()), HandlerGuardInterceptor()]
        merged = dict(message_size_options() + _SERVER_OPTIONS + list(options or ()))
        self.server = grpc.aio.server(options=list(merged.items()), interceptors=interceptors)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            self.service_names + [health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        try:
            if config.tls:
                self.port = self.server.add_secure_port(config.bind_address,
                                                        config.server_credentials())
            else:
                self.port = self.server.add_insecure_port(config.bind_address)
        except RuntimeError as e:
            raise ValueError(f"cannot listen on {config.bind_address}: {e}") from None
        if self.port == 0:
            raise ValueError(f"cannot listen on {config.bind_address}")
        self.stopping = asyncio.Event()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    def report_address(self) -> None:
        """Tells whoever passed ``ready_fd`` where this server listens (once serving)."""
        if self.config.ready_fd is None:
            return
        try:
            with open(self.config.ready_fd, "w", closefd=True) as f:
                f.write(self.address + "\n")
        except OSError as e:  # the launcher is gone: nobody to tell
            logger.warning("could not report the address on fd %d: %s", self.config.ready_fd, e)

    async def start(self, serving: bool = True) -> None:
        """Starts the server; its health SERVING, or with ``serving=False`` NOT_SERVING until
        ``mark_serving()`` (a service whose start goes on once it listens)."""
        await self.server.start()
        status = health_pb2.HealthCheckResponse
        for name in ["", *self.service_names]:
            await self.health.set(name, status.SERVING if serving else status.NOT_SERVING)

    async def mark_serving(self) -> None:
        """SERVING, unless a stop began meanwhile (its NOT_SERVING stands)."""
        if self.stopping.is_set():
            return
        for name in ["", *self.service_names]:
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if stop_asked.is_set():  # before this service could take it (process_exit.py)
            self.stopping.set()
        if self.config.parent_fd is not None:
            self._watch_parent(loop, self.config.parent_fd)

    def _watch_parent(self, loop: asyncio.AbstractEventLoop, fd: int) -> None:
        """Stops the service at the parent pipe's end of file (see ServerConfig.parent_fd)."""
        def readable() -> None:
            try:
                data = os.read(fd, 64)
            except BlockingIOError:
                return
            except OSError as e:
                data = b""
                logger.warning("the parent pipe (fd %d) failed: %s", fd, e)
            if data:  # nobody writes to it; a launcher that does is ignored
                return
            loop.remove_reader(fd)
            os.close(fd)
            if not self.stopping.is_set():
                logger.warning("the launcher that started this service is gone: stopping")
                self.stopping.set()

        try:
            os.set_blocking(fd, False)
            loop.add_reader(fd, readable)
        except OSError as e:
            raise ValueError(f"parent_fd {fd} is not an open pipe: {e}") from None

    async def drain_and_stop(self, num_inflight: Callable[[], int]) -> None:
        """NOT_SERVING at once, wait for requests in flight, then stop with the grace period."""
        await self.health.enter_graceful_shutdown()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        while num_inflight() > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if num_inflight() > 0:
            logger.warning("stopping with %d requests still in flight", num_inflight())
        await self.server.stop(self.config.grace_s)


async def serve(server: GrpcServer, num_inflight: Callable[[], int],
                on_started: Callable[[], Awaitable[None]] | None = None,
                on_stopping: Callable[[], Awaitable[None]] | None = None,
                metrics: Callable[[], list] | None = None) -> None:
    """Runs ``server`` until SIGTERM/SIGINT (or ``server.stopping`` is set), then drains.
    ``metrics``: the service's ``MetricFamily`` list, served at ``metrics_port`` if set. A
    stop asked before (while the service loaded) returns at once: it never serves."""
    server.install_signal_handlers()
    if server.stopping.is_set():
        logger.info("stopped while starting: exiting without serving")
        return
    exporter = _start_metrics(server.config, metrics)
    try:
        # NOT_SERVING until its start is done (a worker's Redis registration and KV handles,
        # in on_started): a health check that saw it serving before sent it work it refused.
        await server.start(serving=on_started is None)
        if on_started is not None:
            await on_started()
            await server.mark_serving()
        # Startup is over: full collections from now on skip its heap (engine/gc_policy.py).
        freeze_startup_heap()
        server.report_address()
        logger.info("serving %s on %s", ", ".join(server.service_names), server.address)
        await server.stopping.wait()
        logger.info("stopping: draining %d requests", num_inflight())
        await _bounded_stop(server, num_inflight, on_stopping)
    finally:
        if exporter is not None:
            exporter.stop()


# Stopping past the drain and the grace by this much is a bug somewhere; the process exits.
STOP_SLACK_S = 10.0


def worst_case_stop_s(drain_timeout_s: float, grace_s: float) -> float:
    """The longest a service takes from SIGTERM to its exit by its own bounds: the bounded
    stop (leaving the registry, the drain, the grace, the slack), a stop stuck in gRPC (the
    slack again), the engine's shutdown, then the exit watchdog. A supervisor that kills it
    sooner (a launcher, compose's stop_grace_period) may cut a stop that would have ended,
    leaving its leases and registry entries to expire instead."""
    return drain_timeout_s + grace_s + 2 * STOP_SLACK_S + SHUTDOWN_TIMEOUT_S + EXIT_GRACE_S


async def _bounded_stop(server: GrpcServer, num_inflight: Callable[[], int],
                        on_stopping: Callable[[], Awaitable[None]] | None) -> None:
    """``on_stopping``, then drain and stop, within the drain timeout, the grace and a slack.
    A step that never ends would keep the process up until its supervisor kills it; past the
    bound, the stacks of the coroutines still pending go to the log and the stop goes on."""
    async def stop() -> None:
        # NOT_SERVING before the service's own stopping work (leaving the registry waits
        # for Redis): a health check in the meantime must not see it serving.
        await server.health.enter_graceful_shutdown()
        if on_stopping is not None:
            await on_stopping()
        await server.drain_and_stop(num_inflight)

    bound = server.config.drain_timeout_s + server.config.grace_s + STOP_SLACK_S
    task = asyncio.ensure_future(stop())
    done, _ = await asyncio.wait({task}, timeout=bound)
    if done:
        task.result()
        return
    logger.error("the service has not stopped %.1f s after SIGTERM; pending coroutines "
                 "follow, then the process exits", bound)
    for t in asyncio.all_tasks():
        if t is not asyncio.current_task():
            logger.error("pending: %s", _await_chain(t.get_coro()))
    task.cancel()
    # Cut every call now; a stop stuck in gRPC itself gets the slack once more, no longer.
    await asyncio.wait({asyncio.ensure_future(server.server.stop(0))}, timeout=STOP_SLACK_S)


def _await_chain(coro) -> str:
    """Where a pending coroutine waits: its chain of awaited coroutines, outermost first."""
    parts = []
    while coro is not None and len(parts) < 32:
        frame = getattr(coro, "cr_frame", None)
        where = f" ({frame.f_code.co_filename}:{frame.f_lineno})" if frame is not None else ""
        parts.append(f"{getattr(coro, '__qualname__', type(coro).__name__)}{where}")
        coro = getattr(coro, "cr_await", None)
    return " -> ".join(parts)


def _start_metrics(config: ServerConfig, metrics: Callable[[], list] | None):
    if config.metrics_port is None or metrics is None:
        return None
    from engine.metrics import MetricsServer

    exporter = MetricsServer(config.host, config.metrics_port, metrics,
                             asyncio.get_running_loop())
    exporter.start()
    logger.info("serving metrics on %s", exporter.url)
    return exporter


def run(main: Callable[[], Awaitable[None]]) -> None:
    """asyncio.run on uvloop when it is installed, for a service process's whole life: once
    ``main`` returns or raises SystemExit, the process ends with that status
    (``exit_process``). SIGUSR1 dumps every thread's stack to stderr (the launcher sends it to
    a process that outlives its shutdown grace). A bad $PDSERVE_SWITCH_INTERVAL_MS is a
    ValueError before anything starts."""
    apply_switch_interval()
    faulthandler.register(signal.SIGUSR1, all_threads=True)

    async def main_then_bounded_exit() -> None:
        try:
            await main()
        finally:
            _exit_watchdog(EXIT_GRACE_S)

    try:
        from uvloop import run as run_loop
    except ImportError:  # uvloop is optional on platforms without it
        run_loop = asyncio.run
    try:
        run_loop(main_then_bounded_exit())
    except SystemExit as e:
        # A service that ends with a status (a worker whose engine died) skips the teardown
        # too: its threads may still be blocked in native calls (exit_process).
        exit_process(exit_status(e.code))
    exit_process()


# After the service has stopped, the loop's executor and the interpreter join their threads.
# One still blocked (in a lock of an engine that died under it, or in a native call) would hold
# the exit forever: past this the stacks go to stderr and the process exits with status 1.
EXIT_GRACE_S = 5.0


def _exit_watchdog(grace_s: float) -> None:
    def fire() -> None:
        logger.error("the process has not exited %.0f s after the service stopped; "
                     "stacks follow, exiting", grace_s)
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)

    timer = threading.Timer(grace_s, fire)
    timer.daemon = True
    timer.start()
