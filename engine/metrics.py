"""Prometheus metrics over HTTP: ``GET /metrics`` on each service's ``--metrics-port``.

Every service (router, prefill and decode workers) can serve its counters and gauges in the
Prometheus text exposition format (version 0.0.4), so a dashboard or an autoscaler scrapes
the cluster without speaking gRPC: the router's request counts and latency histograms, and each
worker's KV-cache use and queues (the signals that say which role to scale).

The HTTP server runs in its own thread (the standard library's, one thread per scrape); the
figures are collected on the service's event loop, where they change, so a scrape never reads
a half-updated request or blocks the loop for longer than building the text.
"""
from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from engine.thread_names import named_thread

logger = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# A scrape waits this long for the event loop to collect the figures.
COLLECT_TIMEOUT_S = 5.0
# Seconds a connection may stay silent while sending its request (or stall taking the
# reply) before it is closed: each connection holds a thread, so one left idle or half-sent
# would otherwise hold it for ever (a few hundred of them, a process's threads).
REQUEST_TIMEOUT_S = 10.0
# How often the HTTP server's loop looks for a stop (serve_forever's poll_interval).
_POLL_INTERVAL_S = 0.1
# Seconds; request latencies from a few ms (a cached prompt on a GPU) to minutes (a long
# generation on a CPU).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0, 300.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0,
                         2.5)

_KINDS = ("counter", "gauge", "histogram")


@dataclass
class Histogram:
    """Cumulative-bucket histogram: ``observe`` is one bisect and two adds."""

    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative; +Inf last
    total: float = 0.0

    def __post_init__(self) -> None:
        if not self.buckets or list(self.buckets) != sorted(set(self.buckets)):
            raise ValueError(f"buckets must be strictly increasing, got {self.buckets!r}")
        if not self.counts:
            self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)


Labels = dict[str, str]


@dataclass
class MetricFamily:
    name: str
    kind: str  # counter, gauge or histogram
    help: str
    samples: list[tuple[Labels, float | Histogram]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"kind must be one of {_KINDS}, got {self.kind!r}")
        if self.kind == "counter" and not self.name.endswith("_total"):
            raise ValueError(f"a counter's name ends with _total, got {self.name!r}")

    def add(self, value: float | Histogram, **labels: str) -> MetricFamily:
        self.samples.append((labels, value))
        return self


def render(families: list[MetricFamily]) -> str:
    """The text exposition format of ``families``."""
    out: list[str] = []
    for fam in families:
        out.append(f"# HELP {fam.name} {_escape_help(fam.help)}")
        out.append(f"# TYPE {fam.name} {fam.kind}")
        for labels, value in fam.samples:
            if isinstance(value, Histogram):
                out.extend(_histogram_lines(fam.name, labels, value))
            else:
                out.append(f"{fam.name}{_labels(labels)} {_number(value)}")
    return "\n".join(out) + "\n"


def _histogram_lines(name: str, labels: Labels, h: Histogram) -> list[str]:
    lines, cumulative = [], 0
    for bound, n in zip([*h.buckets, math.inf], h.counts):
        cumulative += n
        le = "+Inf" if bound == math.inf else _number(bound)
        lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {cumulative}")
    lines.append(f"{name}_sum{_labels(labels)} {_number(h.total)}")
    lines.append(f"{name}_count{_labels(labels)} {cumulative}")
    return lines


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape_label(str(v))}"' for k, v in labels.items())
    return "{" + inner + "}"


def _escape_label(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _escape_help(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n")


def _number(v: float) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v))


class MetricsServer:
    """Serves ``render(collect())`` at ``GET /metrics``; ``collect`` runs on ``loop``."""

    def __init__(self, host: str, port: int, collect: Callable[[], list[MetricFamily]],
                 loop: asyncio.AbstractEventLoop) -> None:
        self.collect = collect
        self.loop = loop
        try:
            self.httpd = _http_server(host, port, _handler_for(self))
        except OSError as e:
            raise ValueError(f"cannot serve metrics on {host}:{port}: {e}") from None
        self.host = host
        self.port = self.httpd.server_address[1]
        # shutdown() waits for the serving loop's next poll: at the default 0.5 s that held a
        # service's stop (on its event loop) for up to half a second; 10 polls a second idle
        # cost nothing measurable.
        self._thread = named_thread(self.httpd.serve_forever, "pdserve-metrics",
                                    (_POLL_INTERVAL_S,))

    @property
    def url(self) -> str:
        host = _bare_host(self.host)
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/metrics"

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def text(self) -> str:
        """Collects on the loop (from the HTTP thread) and renders here."""
        async def collect() -> list[MetricFamily]:
            return self.collect()

        families = asyncio.run_coroutine_threadsafe(collect(), self.loop).result(
            COLLECT_TIMEOUT_S)
        return render(families)


class _IPv4Server(ThreadingHTTPServer):
    daemon_threads = True


class _IPv6Server(ThreadingHTTPServer):
    daemon_threads = True
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # "[::]" takes IPv4 scrapes too, as gRPC's bind of it does on the service's port.
        with contextlib.suppress(OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]
                 ) -> ThreadingHTTPServer:
    """Bound to the service's --host, which its gRPC port takes IPv6 ones in brackets ("[::]",
    "[::1]"); the standard library's server is IPv4 alone, and refused them."""
    host = _bare_host(host)
    return (_IPv6Server if ":" in host else _IPv4Server)((host, port), handler)


def _bare_host(host: str) -> str:
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _handler_for(server: MetricsServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S  # the socket's, set per connection by StreamRequestHandler

        def handle(self) -> None:
            try:
                super().handle()
            except ConnectionError as e:
                # The scraper left before its reply (Prometheus' scrape_timeout, a curl cut
                # short): nothing to tell it, and the server's own handler of this prints a
                # traceback to the service's stderr.
                logger.debug("metrics %s: the client left: %r", self.client_address[0], e)

        def do_GET(self) -> None:  # noqa: N802 - the http.server API
            if self.path.split("?", 1)[0] != "/metrics":
                self._reply(404, "text/plain; charset=utf-8", "not found: try /metrics\n")
                return
            try:
                body = server.text()
            except Exception as e:  # noqa: BLE001 - a failed scrape must not kill the thread
                logger.warning("metrics collection failed: %r", e)
                self._reply(500, "text/plain; charset=utf-8", f"collection failed: {e!r}\n")
                return
            self._reply(200, CONTENT_TYPE, body)

        def _reply(self, status: int, ctype: str, body: str) -> None:
            data = body.encode()
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *args) -> None:  # scrapes every few seconds: quiet
            logger.debug("metrics %s: " + fmt, self.client_address[0], *args)

    return Handler
