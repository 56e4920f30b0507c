"""Ports under ``pdserve up``: a port picked for a service and taken before the service binds
it (by another service or another program) does not break the start; a port the user passed is
used as given, and a taken one fails clearly instead of being shared."""
from __future__ import annotations

import concurrent.futures
import os
import socket
import tempfile

import grpc
import pytest

from router import launcher, redis_server
from router.launcher import Cluster, ClusterSpec
from router.redis_server import RedisServer
from tests.proc_signals import fd_targets, tcp_rows

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def taken_port():
    """A port another program listens on."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


def _port(address: str) -> int:
    return int(address.rpartition(":")[2])


def test_redis_picks_again_when_its_port_is_taken_first(monkeypatch, taken_port):
    real = redis_server.free_port
    picks = iter([taken_port, taken_port])  # lost the race twice

    monkeypatch.setattr(redis_server, "free_port",
                        lambda host="127.0.0.1": next(picks, None) or real(host))
    ports = {taken_port}
    fds = _redis_fds(ports)
    with RedisServer() as r:
        assert r.port != taken_port
        ports.add(r.port)
    with pytest.raises(RuntimeError, match="Address already in use"):
        RedisServer(port=taken_port)  # a port asked for is never changed
    # Every attempt's server log was closed with it, and every connection that asked a port
    # who answers there: a launcher that restarts Redis leaks none. Only fds of those kinds
    # count: another test's leftover threads (a gRPC channel retrying) open and close theirs
    # meanwhile, and an fd number they freed may come back as one of ours.
    assert _redis_fds(ports) - fds == set()


def _redis_fds(ports: set[int]) -> set[tuple[str, str]]:
    """(fd, what it is) for this process's fds of the kinds a RedisServer opens: its servers'
    logs (temporary files) and TCP connections to or from ``ports``."""
    tmp = os.path.join(tempfile.gettempdir(), "")
    socks = _tcp_inodes(ports)
    return {(fd, target) for fd, target in fd_targets().items()
            if target.startswith(tmp) or (target.startswith("socket:[")
                                          and target[8:-1] in socks)}


def _tcp_inodes(ports: set[int]) -> set[str]:
    """The inodes of the host's TCP sockets with either end on one of ``ports``."""
    return {r[9] for r in tcp_rows()
            if {int(r[1].rpartition(":")[2], 16), int(r[2].rpartition(":")[2], 16)} & ports}


def test_the_router_binds_its_own_port_and_reports_it(monkeypatch, taken_port, preset_path):
    preset_path("tiny-llama")  # generated before the router loads its tokenizer
    # What the launcher once did: pick a port here for the service to bind later. Every pick
    # losing the race must not matter any more.
    monkeypatch.setattr(launcher, "free_port", lambda host="127.0.0.1": taken_port,
                        raising=False)
    with RedisServer() as r:
        cluster = Cluster(ClusterSpec(redis_url=r.url))
        try:
            proc = cluster.start_router()
            assert cluster.router_address == proc.address
            assert _port(proc.address) not in (0, taken_port)
        finally:
            cluster.stop()
        assert cluster.procs == []


def test_an_explicit_port_in_use_fails_instead_of_being_shared(preset_path):
    preset_path("tiny-llama")
    # Another gRPC server: gRPC's default SO_REUSEPORT would let a second one bind beside it.
    other = grpc.server(concurrent.futures.ThreadPoolExecutor(1))
    port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    try:
        with RedisServer() as r:
            cluster = Cluster(ClusterSpec(redis_url=r.url, router_port=port))
            try:
                with pytest.raises(RuntimeError, match="router exited with 2 while starting"):
                    cluster.start_router()
            finally:
                cluster.stop()
    finally:
        other.stop(0)


def test_a_worker_that_fails_before_serving_is_named_by_role_and_pid(preset_path):
    """Its name holds "{port}" until it reports its port; the error said
    "prefill-{port} exited with 2" (a flag the worker refused, e.g. -tp 3 on 8 heads). Its
    last stderr line follows: why, which was only somewhere above among every service's."""
    preset_path("tiny-llama")
    with RedisServer() as r:
        cluster = Cluster(ClusterSpec(redis_url=r.url))
        try:
            cluster.start_router()
            with pytest.raises(RuntimeError,
                               match=r"^the prefill worker \(pid \d+\) exited with 2 while "
                                     r"starting: pdserve: error: max_num_seqs must be a "
                                     r"positive integer, got 0$"):
                cluster.add_worker("prefill", extra=["--max-num-seqs", "0"])
        finally:
            cluster.stop()
