"""``pdserve up``'s supervisor with real processes: a crashed worker, router or Redis is
started again and the cluster serves; a worker that stops cleanly stays down; crashes beyond
the budget stop the cluster."""
from __future__ import annotations

import asyncio
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import grpc
import pytest

from client import Client
from engine.cli_up import _serve_until_stopped
from protos import router_pb2_grpc
from router import supervisor
from router.errors import REGISTRY_UNREACHABLE
from router.launcher import Cluster, ClusterSpec, Proc
from router.registry import Registry
from router.supervisor import Supervisor
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture()
def cluster():
    spec = ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _proc(cluster, role):
    return next(p for p in cluster.procs if p.role == role)


def _crash(proc) -> None:
    proc.popen.kill()
    proc.popen.wait()


def _serves(cluster) -> str:
    with Client(cluster.router_address, timeout=60) as c:
        return c.complete(random_prompts(1, seed=3)[0], max_tokens=4, **GREEDY).usage.decode_worker_id


def test_crashed_services_are_started_again_within_the_budget(cluster):
    said: list[str] = []
    sup = Supervisor(cluster, max_restarts=1, say=said.append)
    assert sup.check() is None and not said  # all well: nothing to do
    old = _proc(cluster, "decode")
    _crash(old)
    assert sup.check() is None
    new = _proc(cluster, "decode")
    assert new.name != old.name and new.popen.poll() is None
    assert any(f"{old.name} exited with -9" in line for line in said)
    cluster.wait_routable(1, 1)
    assert _serves(cluster) == new.name
    # The router and Redis come back on their own addresses.
    address = cluster.router_address
    _crash(_proc(cluster, "router"))
    redis = cluster.redis
    redis.proc.kill()
    redis.proc.wait()
    assert sup.check() is None
    assert cluster.router_address == address and cluster.redis.proc.poll() is None
    cluster.wait_routable(1, 1)
    assert _serves(cluster) == new.name
    # A second decode crash within the window is over the budget of 1.
    _crash(new)
    assert sup.check() == 1
    assert "--max-restarts 1" in said[-1]


def test_a_worker_that_stops_cleanly_stays_down(cluster):
    said: list[str] = []
    sup = Supervisor(cluster, say=said.append)
    worker = _proc(cluster, "prefill")
    worker.popen.send_signal(signal.SIGTERM)  # scaled down: it drains and exits 0
    assert worker.popen.wait(timeout=60) == 0
    assert sup.check() is None
    assert worker not in cluster.procs
    assert not any(p.role == "prefill" for p in cluster.procs)
    assert "stopped cleanly" in said[-1]


def _then(cluster, monkeypatch, after) -> None:
    """``after(new)`` once a crashed service was started again and is healthy, before the
    supervisor waits for the router to list it."""
    respawn = cluster.respawn

    def respawn_then(proc, should_abort=None):
        new = respawn(proc, should_abort)
        after(new)
        return new

    monkeypatch.setattr(cluster, "respawn", respawn_then)


# The slow tier (9 s): the crash budget itself is test_crashed_services_are_started_again_
# within_the_budget's; this is the count's edge, a crash before the worker is listed.
@pytest.mark.slow
def test_a_worker_that_crashes_again_before_it_is_listed_counts_one_more_crash(
        cluster, monkeypatch):
    """It was waited on for 30 s, then the cluster stopped, as for a worker the router does
    not take."""
    async def gone(worker_id: str) -> None:  # its heartbeat stale past the TTL: purged
        registry = Registry.from_url(cluster.redis_url, cluster.spec.namespace)
        await registry.deregister(worker_id)
        await registry.r.aclose()

    def crash_unlisted(new: Proc) -> None:
        _crash(new)
        asyncio.run(gone(new.name))

    _then(cluster, monkeypatch, crash_unlisted)
    said: list[str] = []
    sup = Supervisor(cluster, max_restarts=2, say=said.append)
    _crash(_proc(cluster, "decode"))
    assert sup.check() is None
    assert said[-1].endswith("exited with -9 before the router listed it")
    monkeypatch.undo()
    assert sup.check() is None  # the second crash: counted, and started again
    assert "starting it again (2 of 2" in said[-2] and "serving on" in said[-1]
    cluster.wait_routable(1, 1)
    assert _serves(cluster) == _proc(cluster, "decode").name


def test_a_worker_started_while_redis_is_unreachable_is_taken_as_serving(cluster, monkeypatch):
    """The router cannot list workers then (UNAVAILABLE); the cluster stopped after 30 s,
    where the worker would register once Redis is back."""
    def redis_crashes(new: Proc) -> None:
        cluster.redis.proc.kill()
        cluster.redis.proc.wait()

    _then(cluster, monkeypatch, redis_crashes)
    said: list[str] = []
    sup = Supervisor(cluster, say=said.append)
    _crash(_proc(cluster, "decode"))
    assert sup.check() is None
    assert "the router could not say if it lists it: UNAVAILABLE: the worker registry " \
           "(Redis) is unreachable" in said[-1]
    monkeypatch.undo()
    assert sup.check() is None  # Redis started again; the workers register there again
    assert "redis-server serving again" in said[-1]
    cluster.wait_routable(1, 1)
    assert _serves(cluster) == _proc(cluster, "decode").name


class _AdminNotListing(router_pb2_grpc.RouterAdminServicer):
    """A router's admin service whose listing answers UNAVAILABLE with ``details``, carrying
    ``trailing``."""

    def __init__(self, details: str, trailing: tuple) -> None:
        self.details, self.trailing = details, trailing

    def ListWorkers(self, request, context):
        context.set_trailing_metadata(self.trailing)
        context.abort(grpc.StatusCode.UNAVAILABLE, self.details)


@pytest.mark.parametrize("trailing, unreachable", [((), False), (REGISTRY_UNREACHABLE, True)])
def test_only_the_routers_mark_says_the_registry_is_unreachable(trailing, unreachable):
    """A restarted worker is taken as serving, unconfirmed, when the router cannot list
    workers because Redis does not answer: said by the admin service's mark, not by the word
    "registry" in a status message, which any other UNAVAILABLE may hold (a worker was then
    taken as serving unchecked)."""
    details = "the worker registry entry is being rewritten: try again"
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    router_pb2_grpc.add_RouterAdminServicer_to_server(_AdminNotListing(details, trailing),
                                                      server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
                for _ in range(2)]
    try:
        cluster = Cluster(ClusterSpec(model=MODEL))
        cluster.router_address = f"127.0.0.1:{port}"
        worker = Proc("decode-1", "127.0.0.1:1", sleepers[1], template="decode-{port}")
        cluster.procs += [Proc("router", cluster.router_address, sleepers[0],
                               template="router"), worker]
        if unreachable:
            assert cluster.wait_listed(worker, timeout_s=30) == f"UNAVAILABLE: {details}"
        else:
            with pytest.raises(RuntimeError, match="the router does not list decode-1"):
                cluster.wait_listed(worker, timeout_s=0.5)
    finally:
        server.stop(None)
        for p in sleepers:
            p.kill()
            p.wait()


def test_a_restarted_worker_the_router_refuses_stops_the_cluster(tmp_path, preset_path):
    """The model's folder changed under the running cluster: the worker started again serves
    another model, which the router sends no requests. It was reported as serving, and the
    cluster went on without it, as `pdserve up` would not have started."""
    model = tmp_path / "model"
    shutil.copytree(preset_path("micro-llama"), model)
    spec = ClusterSpec(model=str(model), num_prefill=0, num_decode=1, worker_args=WORKER_ARGS)
    with Cluster(spec) as cluster:
        said: list[str] = []
        sup = Supervisor(cluster, say=said.append)
        generation = model / "generation_config.json"
        generation.write_text(json.dumps({**json.loads(generation.read_text()),
                                          "temperature": 0.25}))
        _crash(_proc(cluster, "decode"))
        assert sup.check() == 1
        assert "decode could not be started again" in said[-1]
        assert "the router sends it no requests: its model's config or tokenizer files " \
               "differ from this router's" in said[-1]


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(Cluster(ClusterSpec(model=MODEL)), max_restarts=-1)
    with pytest.raises(ValueError, match="retry_backoff_s"):
        Supervisor(Cluster(ClusterSpec(model=MODEL)), retry_backoff_s=-1.0)


def _crashed_worker(cluster: Cluster) -> Proc:
    """A decode worker of ``cluster`` that crashed (exit 3)."""
    dead = subprocess.Popen(["sh", "-c", "exit 3"])
    dead.wait()
    proc = Proc("decode-1234", "127.0.0.1:1234", dead, template="decode-{port}",
                args=["decode", "--port", "0"])
    cluster.procs.append(proc)
    return proc


def test_a_stop_while_a_crashed_worker_starts_again_ends_the_wait():
    # --start-timeout 20: without the stop reaching the wait, the run would end after it, 1.
    cluster = Cluster(ClusterSpec(model=MODEL, redis_url="redis://127.0.0.1:1", start_timeout_s=20))
    cluster.router_address = "127.0.0.1:1"
    _crashed_worker(cluster)
    stop = threading.Event()
    started: list[Proc] = []

    def spawn(name, args, env=None) -> Proc:
        # The new worker loads its model (it never reports its address) when the stop comes.
        r, w = os.pipe()
        proc = Proc(name, "", subprocess.Popen(["sleep", "600"], pass_fds=(w,)),
                    ready=os.fdopen(r, "rb"), template=name, args=args, env=env)
        os.close(w)
        cluster.procs.append(proc)
        started.append(proc)
        stop.set()  # SIGTERM / Ctrl-C: pdserve up's handler sets it
        return proc

    cluster._spawn = spawn
    args = SimpleNamespace(decode=1, prefill=1, model="tiny-llama", max_restarts=5)
    try:
        assert _serve_until_stopped(args, cluster.spec, cluster, Supervisor, stop) == 0
        assert started and started[0].popen.poll() is not None  # the new one stopped again
        assert not cluster.procs
    finally:
        cluster.stop()


def test_a_service_that_cannot_be_started_again_stops_the_cluster_cleanly(monkeypatch):
    # Redis: its port taken meanwhile, or it never answers; a worker: no process at all.
    dead = subprocess.Popen(["true"])
    dead.wait()
    cluster = SimpleNamespace(redis=SimpleNamespace(proc=dead, port=6399, host="127.0.0.1"),
                              procs=[])

    def failing_redis(**kwargs):
        raise RuntimeError("redis-server exited with 1: Address already in use")

    monkeypatch.setattr(supervisor, "RedisServer", failing_redis)
    said: list[str] = []
    assert Supervisor(cluster, say=said.append).check() == 1
    assert "redis-server could not be started again (redis-server exited with 1" in said[-1]

    cluster = Cluster(ClusterSpec(model=MODEL, redis_url="redis://127.0.0.1:1"))
    _crashed_worker(cluster)

    def no_process(name, args, env=None):
        raise OSError(errno.EMFILE, "Too many open files")

    cluster._spawn = no_process
    said.clear()
    try:
        assert Supervisor(cluster, say=said.append).check() == 1
        assert "decode could not be started again ([Errno 24] Too many open files)" in said[-1]
    finally:
        cluster.stop()


def _zombie(pid: int) -> int:
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # exited; not reaped
    return pid


def test_as_pid_1_the_supervisor_reaps_orphans_but_not_its_own_children():
    """Where the launcher is PID 1 the processes a crashed service left are re-parented to it,
    and nothing else reaps them; its own children it must leave to their Popen objects, which
    would otherwise take a crash for a clean exit (0)."""
    assert not Supervisor(SimpleNamespace(redis=None, procs=[])).reap_orphans  # not PID 1
    orphan = _zombie(os.posix_spawn("/bin/sh", ["sh", "-c", "exit 3"], os.environ))
    own = subprocess.Popen(["sleep", "600"])
    own.kill()
    _zombie(own.pid)
    crashed = Proc("decode-1234", "127.0.0.1:1234", own, template="decode-{port}")
    said: list[str] = []
    sup = Supervisor(SimpleNamespace(redis=None, procs=[crashed]), max_restarts=0,
                     say=said.append, reap_orphans=True)
    assert sup.check() == 1  # the worker's crash seen as one: -9, over the budget of 0
    assert own.returncode == -signal.SIGKILL and "exited with -9" in said[-1]
    with pytest.raises(ChildProcessError):  # reaped
        os.waitpid(orphan, os.WNOHANG)


def test_a_start_that_keeps_failing_waits_at_most_the_longest_wait():
    """A service refused at every start, under a budget its 60 s waits never spend (more than
    ten restarts within the 10-minute window), is tried for as long as the cluster runs: its
    1025th wait (17 hours in) was 2 s times 2**1024, a float's overflow, which ended
    ``pdserve up`` with a traceback."""
    cluster = Cluster(ClusterSpec(model=MODEL))
    try:
        sup = Supervisor(cluster, max_restarts=20, say=(said := []).append)
        dead = Proc("decode-1", "", subprocess.Popen([sys.executable, "-c", "exit(3)"]),
                    template="decode-{port}", args=["decode", "--no-such-flag"])
        dead.popen.wait()
        sup.pending.append(supervisor.PendingStart(dead, "decode-1 exited with 3", due=0.0,
                                                   failed_starts=1100))
        assert sup.check() is None  # its new process exits 2 (the flag refused)
        (again,) = sup.pending
        assert again.failed_starts == 1101
        assert said[-1].endswith(f"; starting it again in {supervisor.RETRY_BACKOFF_MAX_S:.0f} "
                                 f"s (1 of 20 within 600 s)"), said[-1]
    finally:
        cluster.stop()
