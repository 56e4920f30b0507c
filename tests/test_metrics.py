"""Prometheus metrics: the exposition format, histograms, the HTTP exporter on a real socket,
and the router's and a worker's metric families from real stats objects. The cluster-level
scrape is in test_serving.py."""
from __future__ import annotations

import asyncio
import math
import threading

import grpc
import pytest

from engine.grpc_server import ServerConfig
from engine.metrics import (CONTENT_TYPE, Histogram, MetricFamily, MetricsServer, render)
from engine.worker_metrics import worker_metrics
from protos import common_pb2, router_pb2
from router.stats import PHASES, RouterStats, SequenceEnd
from tests.serving_helpers import parse_metrics, scrape


def test_histogram_buckets_are_cumulative_with_sum_and_count():
    h = Histogram((0.1, 1.0))
    for v in (0.05, 0.1, 0.5, 3.0, float("nan")):
        h.observe(v)
    m = parse_metrics(render([MetricFamily("lat_seconds", "histogram", "x").add(h, phase="a")]))
    assert m[("lat_seconds_bucket", frozenset({("phase", "a"), ("le", "0.1")}))] == 2
    assert m[("lat_seconds_bucket", frozenset({("phase", "a"), ("le", "1.0")}))] == 3
    assert m[("lat_seconds_bucket", frozenset({("phase", "a"), ("le", "+Inf")}))] == 4
    assert m[("lat_seconds_count", frozenset({("phase", "a")}))] == 4  # NaN is dropped
    assert m[("lat_seconds_sum", frozenset({("phase", "a")}))] == pytest.approx(3.65)


def test_render_escapes_labels_and_writes_help_and_type():
    text = render([MetricFamily("odd_total", "counter", 'a "help"\nline')
                   .add(3, worker_id='w"1\\x\ny'),
                   MetricFamily("g", "gauge", "g").add(float("inf")).add(0.25, k="v")])
    assert '# HELP odd_total a "help"\\nline' in text
    assert "# TYPE odd_total counter" in text
    assert 'odd_total{worker_id="w\\"1\\\\x\\ny"} 3' in text
    m = parse_metrics(text)
    assert m[("g", frozenset())] == math.inf and m[("g", frozenset({("k", "v")}))] == 0.25


@pytest.mark.parametrize("kwargs, match", [
    (dict(name="requests", kind="counter"), "ends with _total"),
    (dict(name="x", kind="summary"), "kind must be one of"),
])
def test_bad_families_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MetricFamily(help="h", **kwargs)


@pytest.mark.parametrize("buckets", [(), (1.0, 0.5), (1.0, 1.0)])
def test_bad_buckets_are_refused(buckets):
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram(buckets)


@pytest.mark.parametrize("port", [-1, 70000, True, "9090", 1.5])
def test_a_bad_metrics_port_is_refused(port):
    with pytest.raises(ValueError, match="metrics_port"):
        ServerConfig(metrics_port=port)


class _Loop:
    """An event loop running in a thread, as a service's is while the exporter serves."""

    def __enter__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        return self.loop

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def test_the_exporter_serves_metrics_404s_elsewhere_and_500s_a_failed_collection():
    calls = []

    def collect():
        calls.append(threading.current_thread())
        if len(calls) == 2:
            raise RuntimeError("stats are gone")
        return [MetricFamily("up_total", "counter", "scrapes").add(len(calls))]

    with _Loop() as loop:
        server = MetricsServer("127.0.0.1", 0, collect, loop)
        server.start()
        try:
            status, ctype, body = scrape(server.port)
            assert status == 200 and ctype == CONTENT_TYPE
            assert parse_metrics(body) == {("up_total", frozenset()): 1.0}
            assert calls[0] is not threading.current_thread()  # collected on the loop's thread
            status, _, body = scrape(server.port)
            assert status == 500 and "stats are gone" in body
            assert scrape(server.port, "/other")[0] == 404
            assert scrape(server.port, "/metrics?x=1")[0] == 200  # a query string is fine
            with pytest.raises(ValueError, match="cannot serve metrics"):
                MetricsServer("127.0.0.1", server.port, collect, loop)  # port taken
        finally:
            server.stop()


def test_a_half_sent_request_does_not_hold_its_thread_for_ever(monkeypatch):
    """Each connection has a thread: one that never finishes its request is closed once
    REQUEST_TIMEOUT_S passes, and scrapes go on."""
    import socket

    import engine.metrics

    monkeypatch.setattr(engine.metrics, "REQUEST_TIMEOUT_S", 0.2)
    with _Loop() as loop:
        server = MetricsServer("127.0.0.1", 0, lambda: [], loop)
        server.start()
        try:
            with socket.create_connection(("127.0.0.1", server.port)) as s:
                s.sendall(b"GET /metr")  # and nothing more
                s.settimeout(60)  # far past the server's: without its timeout this raises
                assert s.recv(4096) == b""  # closed by the server, with no reply
            assert scrape(server.port)[0] == 200
        finally:
            server.stop()


def test_a_scraper_that_leaves_before_its_reply_leaves_no_traceback(capfd):
    """Prometheus cuts a scrape at its scrape_timeout (a loop busy past it), curl at a Ctrl-C:
    the reply's write then fails with ConnectionResetError, which the standard library's
    server printed to the service's stderr as a traceback, each time."""
    import socket
    import struct

    asked, answer = threading.Event(), threading.Event()

    def collect():
        asked.set()
        answer.wait(10)  # bounded: the test's own loop, held until the client has left
        return [MetricFamily("up_total", "counter", "scrapes").add(1)]

    with _Loop() as loop:
        server = MetricsServer("127.0.0.1", 0, collect, loop)
        server.httpd.daemon_threads = False  # so that stop() joins the request's thread
        server.start()
        try:
            s = socket.create_connection(("127.0.0.1", server.port))
            s.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
            assert asked.wait(10)
            # Closed with a reset, as a client cut short does: the server's writes then fail.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
            answer.set()
            assert scrape(server.port)[0] == 200  # the server goes on
        finally:
            server.stop()
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception occurred" not in err, err


def _has_ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this host")
@pytest.mark.parametrize("host, scraped_at", [("[::1]", "[::1]"), ("::1", "[::1]"),
                                              ("[::]", "[::1]"), ("[::]", "127.0.0.1")])
def test_an_ipv6_host_is_served_as_the_grpc_port_takes_it(host, scraped_at):
    """`--host [::]` (an IPv6 or dual-stack pod) serves gRPC; the exporter, IPv4 alone, refused
    it ("Name or service not known") and the service stopped before it served. "[::]" takes
    IPv4 scrapes too, as gRPC's port does."""
    def collect():
        return [MetricFamily("up_total", "counter", "scrapes").add(1)]

    with _Loop() as loop:
        server = MetricsServer(host, 0, collect, loop)
        server.start()
        try:
            status, _, body = scrape(server.port, host=scraped_at)
            assert status == 200 and parse_metrics(body) == {("up_total", frozenset()): 1.0}
            bare = host.strip("[]")
            assert server.url == f"http://[{bare}]:{server.port}/metrics"
        finally:
            server.stop()


def test_router_families_count_finished_requests_and_their_phases():
    from router.metrics import router_metrics

    stats = RouterStats(max_inflight=8, requests_total=4, generation_tokens=11,
                        requests_prefilled_remotely=2)
    stats.request_failed(grpc.StatusCode.CANCELLED)
    stats.request_failed(grpc.StatusCode.RESOURCE_EXHAUSTED)
    for ttft in (0.2, 0.0, 0.3):  # the third got its first token, then failed
        stats.first_token(ttft)
    usage = router_pb2.Usage(completion_tokens=5, timings=router_pb2.RequestTimings(
        ttft_s=0.2, e2e_s=0.6, prefill_compute_s=0.15, kv_transfer_s=0.01))
    stats.request_finished("length", [SequenceEnd(usage, 5)])
    stats.request_finished("stop", [SequenceEnd(router_pb2.Usage(completion_tokens=1), 1)])

    class _Dir:  # no workers known yet
        workers: dict = {}
        worker_hangs = 2

        def is_down(self, w):
            return False

        def candidates(self, role):
            return []

    m = parse_metrics(render(router_metrics(stats, _Dir())))
    assert m[("pdserve_router_requests_total", frozenset())] == 4
    assert [m[("pdserve_router_requests_failed_total", frozenset({("code", code)}))]
            for code in ("CANCELLED", "RESOURCE_EXHAUSTED")] == [1, 1]
    assert stats.requests_failed == 2  # GetClusterStats' sum
    assert m[("pdserve_router_worker_hangs_total", frozenset())] == 2
    assert m[("pdserve_router_generation_tokens_total", frozenset())] == 11
    assert m[("pdserve_router_requests_finished_total",
              frozenset({("finish_reason", "length")}))] == 1
    assert m[("pdserve_router_time_to_first_token_seconds_count", frozenset())] == 3
    assert m[("pdserve_router_e2e_request_latency_seconds_count", frozenset())] == 2
    # TPOT only where there is a second token: (0.6 - 0.2) / 4.
    assert m[("pdserve_router_time_per_output_token_seconds_count", frozenset())] == 1
    assert m[("pdserve_router_time_per_output_token_seconds_sum", frozenset())] == \
        pytest.approx(0.1)
    for phase in PHASES:
        assert m[("pdserve_router_request_phase_seconds_count",
                  frozenset({("phase", phase)}))] == 2
    assert m[("pdserve_router_request_phase_seconds_sum",
              frozenset({("phase", "prefill_compute")}))] == pytest.approx(0.15)
    assert m[("pdserve_router_workers",
              frozenset({("role", "decode"), ("state", "routable")}))] == 0


def test_a_worker_of_another_block_size_is_not_counted_routable():
    """It gets no requests (WorkerDirectory.candidates leaves it out), yet it was counted
    with the routable ones."""
    from types import SimpleNamespace

    from router.metrics import router_metrics

    def worker(wid, draining=False):
        return SimpleNamespace(worker_id=wid, inflight=0, info=common_pb2.WorkerInfo(
            worker_id=wid, role="prefill", draining=draining))

    workers = {w.worker_id: w for w in (worker("a"), worker("b"), worker("c", True),
                                        worker("d"))}

    class _Dir:
        worker_hangs = 0

        def __init__(self):
            self.workers = workers

        def is_down(self, w):
            return w.worker_id == "d"

        def candidates(self, role):  # "b" has another --block-size
            return [workers["a"]] if role == "prefill" else []

    m = parse_metrics(render(router_metrics(RouterStats(max_inflight=8), _Dir())))
    states = {state: m[("pdserve_router_workers",
                        frozenset({("role", "prefill"), ("state", state)}))]
              for state in ("routable", "draining", "down", "other_block_size")}
    assert states == {"routable": 1, "draining": 1, "down": 1, "other_block_size": 1}


def test_worker_families_carry_its_labels_and_usage():
    info = common_pb2.WorkerInfo(worker_id="decode-1", role="decode", model="tiny",
                                 num_free_blocks=96, num_total_blocks=128, num_running=3,
                                 prefix_cache_hits=7, prefix_cache_partial_hits=2,
                                 prefix_cache_evictions=5, leases_forgotten=4,
                                 leases_forget_reading=1, leases_forget_no_room=6,
                                 kv_bytes_transferred=4096, draining=True)
    m = parse_metrics(render(worker_metrics(info)))
    labels = frozenset({("worker_id", "decode-1"), ("role", "decode"), ("model", "tiny")})
    assert m[("pdserve_worker_kv_cache_usage_ratio", labels)] == 0.25
    assert m[("pdserve_worker_requests_running", labels)] == 3
    assert m[("pdserve_worker_prefix_cache_hits_total", labels)] == 7
    assert m[("pdserve_worker_prefix_cache_partial_hits_total", labels)] == 2
    assert m[("pdserve_worker_prefix_cache_evictions_total", labels)] == 5
    assert m[("pdserve_worker_kv_leases_forgotten_total", labels)] == 4
    assert m[("pdserve_worker_kv_leases_forget_reading_total", labels)] == 1
    assert m[("pdserve_worker_kv_leases_forget_no_room_total", labels)] == 6
    assert m[("pdserve_worker_kv_transfer_bytes_total", labels)] == 4096
    assert m[("pdserve_worker_draining", labels)] == 1


def test_a_workers_info_counts_the_cached_blocks_it_evicted(preset_path):
    """The engine counted its prefix-cache evictions, and neither a worker's info nor its
    metrics showed them: nothing told an operator the cache was too small for the load."""
    from engine import SamplingParams
    from engine.config import EngineConfig
    from engine.worker_runtime import WorkerConfig, WorkerRuntime

    async def run():
        rt = await WorkerRuntime.create(WorkerConfig(EngineConfig(
            str(preset_path("tiny-llama")), role="prefill", kv_transfer_backend="torch",
            num_gpu_blocks=8, max_model_len=128)))
        try:
            # 7 blocks of 8 each: the second prompt evicts most of the first's.
            for rid, start in (("first", 10), ("second", 300)):
                outs = [o async for o in rt.engine.generate(
                    rid, list(range(start, start + 112)), SamplingParams(max_tokens=2), [])]
                assert outs[-1].kv_lease is not None
                rt.llm.release_kv(rid)
            await rt.engine.fresh_stats()
            return rt.worker_info()
        finally:
            rt.shutdown()

    info = asyncio.run(run())
    assert info.prefix_cache_evictions >= 5
    labels = frozenset({("worker_id", info.worker_id), ("role", "prefill"),
                        ("model", info.model)})
    m = parse_metrics(render(worker_metrics(info)))
    assert m[("pdserve_worker_prefix_cache_evictions_total", labels)] == \
        info.prefix_cache_evictions
