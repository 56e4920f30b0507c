"""``pdserve up``'s supervisor with real processes: a crashed worker, router or Redis is
started again and the cluster serves; a worker that stops cleanly stays down; crashes beyond
the budget stop the cluster."""
from __future__ import annotations

import signal

import pytest

from client import Client
from router.launcher import Cluster, ClusterSpec
from router.supervisor import Supervisor
from tests.serving_helpers import WORKER_ARGS, random_prompts

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture()
def cluster():
    spec = ClusterSpec(worker_args=WORKER_ARGS, router_args=["--max-local-prefill-length", "0"])
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


def test_a_bad_budget_is_refused():
    with pytest.raises(ValueError, match="max_restarts"):
        Supervisor(Cluster(ClusterSpec()), max_restarts=-1)
