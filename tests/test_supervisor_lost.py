"""``pdserve up``'s supervisor when a worker cannot be started again, with real processes: the
message says why its first process exited and why the new one failed (their last stderr
lines); the cluster serves on without it while a worker of its role is left, and stops once
none is."""
from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest
import redis

from client import Client
from router.launcher import Cluster, ClusterSpec
from router.redis_server import RedisServer, find_redis_server
from router.supervisor import Supervisor
from tests.proc_signals import reap
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts

MODEL = SERVING_MODEL


def _procs(cluster, role):
    return [p for p in cluster.procs if p.role == role]


def _redis_with_databases(port: int, databases: int) -> subprocess.Popen:
    """A redis-server on ``port`` with only ``databases`` databases, once it answers."""
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1",
                             "--databases", str(databases), "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    client = redis.Redis(port=port, socket_connect_timeout=1)
    while True:
        try:
            client.ping()
            return proc
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                reap(proc)
                raise
            time.sleep(0.1)  # it is starting; nothing to wait on but its port


def test_a_worker_refused_at_its_restart_is_named_with_its_first_refusal():
    """Redis came back with fewer databases than the cluster's index: every service refuses
    its configuration and exits 2, the supervisor starts the decode worker again, and the new
    one is refused at its start, as the next one is, which spends the budget. The message said
    only "the decode worker (pid N) exited with 2 while starting; stopping", why somewhere
    above among every service's lines."""
    first = RedisServer()
    port = first.port
    url = f"redis://127.0.0.1:{port}/10"
    spec = ClusterSpec(model=MODEL, redis_url=url, num_prefill=0, num_decode=1,
                       worker_args=WORKER_ARGS)
    smaller = None
    try:
        with Cluster(spec) as cluster:
            sup = Supervisor(cluster, max_restarts=2, say=(said := []).append,
                             retry_backoff_s=0.0)
            first.stop()
            smaller = _redis_with_databases(port, 2)
            for proc in cluster.procs:  # each meets the refusal at its next Redis call
                assert proc.popen.wait(timeout=120) == 2
            assert sup.check() is None  # its first new process refused: one more try
            assert any(line.startswith("pdserve up: decode could not be started again (")
                       and "; starting it again in 0 s (2 of 2 within 600 s)" in line
                       for line in said), said
            assert sup.check() == 1
    finally:
        first.stop()
        if smaller is not None:
            reap(smaller)
    refusal = f"pdserve: error: redis_url '{url}': the Redis server has no database 10"
    line = said[-1]
    assert line.startswith("pdserve up: decode could not be started again (the decode worker "
                           "(pid "), line
    again, _, before = line.partition(" after decode-")
    assert "exited with 2 while starting: " in again and refusal in again, line
    assert "exited with 2: " in before and refusal in before, line  # the first refusal
    assert "; 3 decode crashes within 600 s (--max-restarts 2)" in before, line
    assert line.endswith("; stopping: no decode worker left"), line


def test_a_worker_whose_new_process_exits_while_starting_is_started_again(tmp_path,
                                                                         preset_path):
    """The model's folder unreadable for a moment (a remount, a sync): the decode worker
    started again after a crash exits while starting. It was given up at once (the cluster
    stopped: no decode worker left), with restarts left; it is started again later, and
    serves once the folder is back."""
    model = tmp_path / "model"
    shutil.copytree(preset_path("micro-llama"), model)
    spec = ClusterSpec(model=str(model), num_prefill=0, num_decode=1, worker_args=WORKER_ARGS)
    with Cluster(spec) as cluster:
        sup = Supervisor(cluster, say=(said := []).append, retry_backoff_s=0.0)
        (model / "config.json").rename(tmp_path / "config.json")
        (dead,) = _procs(cluster, "decode")
        dead.popen.kill()
        dead.popen.wait()
        assert sup.check() is None
        assert said[-1].startswith("pdserve up: decode could not be started again (the decode "
                                   "worker (pid "), said[-1]
        assert "exited with 2 while starting: pdserve: error: model folder " in said[-1]
        assert f"after {dead.name} exited with -9" in said[-1], said[-1]
        assert said[-1].endswith("; starting it again in 0 s (2 of 5 within 600 s)"), said[-1]
        assert not _procs(cluster, "decode") and not sup.lost
        (tmp_path / "config.json").rename(model / "config.json")
        assert sup.check() is None
        (new,) = _procs(cluster, "decode")
        assert said[-1] == f"pdserve up: {new.name} serving on {new.address}", said[-1]
        assert not sup.pending and not sup.lost
        _serves(cluster, new.name)


def _serves(cluster, decode_worker: str) -> None:
    with Client(cluster.router_address, timeout=60) as c:
        out = c.complete(random_prompts(1, seed=5)[0], max_tokens=4, temperature=0.0,
                         ignore_eos=True)
    assert out.usage.decode_worker_id == decode_worker


@pytest.mark.timeout(900)
def test_the_cluster_serves_on_without_a_lost_worker_until_none_of_its_role_is_left(
        tmp_path, preset_path):
    """The model's folder changed under the cluster, so a decode worker started again serves
    another model, which the router refuses: that worker is lost. With another decode worker,
    the router and a prefill worker up, the cluster went on serving nothing: the supervisor
    stopped it all, cutting what the healthy workers ran. It now stops the refused worker,
    says so loudly and serves on; losing the last decode worker stops it."""
    model = tmp_path / "model"
    shutil.copytree(preset_path("micro-llama"), model)
    spec = ClusterSpec(model=str(model), num_prefill=1, num_decode=2, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as cluster:
        sup = Supervisor(cluster, say=(said := []).append)
        generation = model / "generation_config.json"
        generation.write_text(json.dumps({**json.loads(generation.read_text()),
                                          "temperature": 0.25}))
        doomed, kept = _procs(cluster, "decode")
        doomed.popen.kill()
        doomed.popen.wait()
        assert sup.check() is None
        assert said[-1].startswith("pdserve up: DEGRADED: decode could not be started again ("),\
            said[-1]
        assert "the router sends it no requests" in said[-1]
        assert f"after {doomed.name} exited with -9" in said[-1]
        assert "serving on without it (1 prefill, 1 decode workers left; 1 lost" in said[-1]
        assert len(sup.lost) == 1 and sup.lost[0].startswith(f"{doomed.name}: ")
        # The refused worker was stopped, not left holding its memory; the rest serve.
        assert _procs(cluster, "decode") == [kept]
        cluster.wait_routable(1, 1)
        _serves(cluster, kept.name)
        assert sup.check() is None and said[-1].startswith("pdserve up: DEGRADED")
        # The last decode worker lost: nothing can serve.
        kept.popen.kill()
        kept.popen.wait()
        assert sup.check() == 1
        assert said[-1].endswith("; stopping: no decode worker left"), said[-1]
        assert f"after {kept.name} exited with -9" in said[-1]
