"""The transfer ledger through failures, across real processes: Redis restarted empty, a live
worker purged, a router restarted while Redis hangs, a prefill worker draining. Each time the
ledger lists the leases still held, and a router restarted under its id releases those its
dead predecessor left (released, not expired: the worker's count of expired leases says)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import grpc
import pytest
import redis

from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from router.redis_server import RedisServer
from router.registry import Registry
from tests.proc_signals import wait_until
from tests.test_transfer_ledger import _proc
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts, worker_info

MODEL = SERVING_MODEL

GREEDY = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
# 60 s leases, and a drain that outlasts a router's restart: nothing here expires by itself.
LEASE_S = 60
ARGS = [*WORKER_ARGS[:-1], str(LEASE_S)]
assert WORKER_ARGS[-2] == "--kv-lease-timeout-s"
# The Redis bound of a router started while Redis hangs (REDIS_TIMEOUT_S is 5 s).
HUNG_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=1, worker_args=ARGS,
                       drain_timeout_s=60, router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _listed(cluster) -> set[str] | None:
    """The transfer ids ListTransfers lists; None while the router cannot list them."""
    try:
        with grpc.insecure_channel(cluster.router_address) as ch:
            resp = router_pb2_grpc.RouterAdminStub(ch).ListTransfers(
                router_pb2.ListTransfersRequest(), timeout=10)
    except grpc.RpcError:
        return None
    return {t.transfer_id for t in resp.transfers}


def _prefill(address: str, rid: str, prompt, **ids) -> None:
    with grpc.insecure_channel(address) as ch:
        resp = worker_pb2_grpc.PrefillWorkerStub(ch).Prefill(worker_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=GREEDY, **ids), timeout=60)
    assert resp.HasField("kv_handle")


def _release(address: str, rid: str) -> bool:
    with grpc.insecure_channel(address) as ch:
        return worker_pb2_grpc.PrefillWorkerStub(ch).ReleaseKV(
            worker_pb2.ReleaseKVRequest(request_id=rid), timeout=10).released


def _router_id(router) -> str:
    return router.args[router.args.index("--router-id") + 1]


def _incarnation(r: redis.Redis, router_id: str) -> str:
    """The incarnation beating for the id (after a Redis outage, once its beat landed)."""
    assert wait_until(lambda: r.get(f"pdserve:router:{router_id}") is not None, 10)
    return r.get(f"pdserve:router:{router_id}").decode()


def _deregister(url: str, worker_id: str) -> None:
    async def run():
        reg = Registry.from_url(url)
        await reg.deregister(worker_id)  # what a router's purge of a stale worker does
        await reg.r.aclose()
    asyncio.run(run())


def test_leases_held_are_listed_again_after_redis_restarts_and_after_a_purge(cluster):
    prefill = _proc(cluster, "prefill")
    held = {"held~0", "held~1"}
    for rid, p in zip(sorted(held), random_prompts(2, seed=41, lo=30, hi=60)):
        _prefill(prefill.address, rid, p, router_id="ops")
    assert wait_until(lambda: _listed(cluster) == held, 10)
    # Redis restarted empty on its port (pdserve up's supervisor restarts it so; no
    # persistence): the worker's republish puts back what it holds.
    port = cluster.redis.port
    cluster.redis.stop()
    cluster.redis = RedisServer(port=port, exit_with_parent=True)
    assert wait_until(lambda: _listed(cluster) == held, 30)
    # Purged while it lives (its beat was late): its next beat finds it dropped.
    _deregister(cluster.redis_url, prefill.name)
    assert wait_until(lambda: _listed(cluster) == held, 30)
    assert worker_info(prefill.address).num_leased == 2
    assert all(_release(prefill.address, rid) for rid in held)
    assert wait_until(lambda: _listed(cluster) == set(), 10)


def test_a_router_restarted_while_redis_hangs_releases_what_its_predecessor_left(cluster):
    router, prefill = _proc(cluster, "router"), _proc(cluster, "prefill")
    router_id = _router_id(router)
    r = redis.Redis.from_url(cluster.redis_url)
    incarnation = _incarnation(r, router_id)
    expired = worker_info(prefill.address).num_expired_leases
    orphans = {"orphan~0", "orphan~1"}
    for rid, p in zip(sorted(orphans), random_prompts(2, seed=42, lo=30, hi=60)):
        _prefill(prefill.address, rid, p, router_id=router_id, router_incarnation=incarnation)
    assert wait_until(lambda: _listed(cluster) == orphans, 10)
    router.popen.kill()
    router.popen.wait(timeout=10)
    # The new router bounds its Redis calls by 1 s, not 5 (router/redis_bound.py's test hook):
    # its start makes four in turn, each of which waits out the hang, and then its reclaim's
    # first ledger read, which the hang fails too. The same calls fail, 16 s sooner.
    env = router.env
    router.env = {**(env or os.environ), "PDSERVE_TEST_REDIS_TIMEOUT_S": str(HUNG_TIMEOUT_S)}
    os.kill(cluster.redis.proc.pid, signal.SIGSTOP)
    try:
        new = cluster.respawn(router)
        # Past any Redis call the new router made at its start: each has failed by now.
        time.sleep(HUNG_TIMEOUT_S + 1.0)
    finally:
        os.kill(cluster.redis.proc.pid, signal.SIGCONT)
    new.env = env  # its respawn in the next test bounds its calls as a router does
    assert wait_until(lambda: worker_info(prefill.address).num_leased == 0, LEASE_S)
    assert worker_info(prefill.address).num_expired_leases == expired
    assert wait_until(lambda: _listed(cluster) == set(), 10)


def test_a_draining_worker_s_leases_stay_listed_for_a_restarted_router_to_release(cluster):
    """Last here: the prefill worker stops. While it drains, out of the routers' view, the
    ledger lists the leases it drains for and the closes of those that end; a router
    restarted meanwhile releases its predecessor's at the worker's address."""
    router, prefill = _proc(cluster, "router"), _proc(cluster, "prefill")
    router_id = _router_id(router)
    r = redis.Redis.from_url(cluster.redis_url)
    incarnation = _incarnation(r, router_id)
    expired = worker_info(prefill.address).num_expired_leases
    p0, p1 = random_prompts(2, seed=43, lo=30, hi=60)
    _prefill(prefill.address, "orphan~0", p0, router_id=router_id, router_incarnation=incarnation)
    _prefill(prefill.address, "kept~0", p1, router_id="ops")
    assert wait_until(lambda: _listed(cluster) == {"orphan~0", "kept~0"}, 10)
    router.popen.kill()
    router.popen.wait(timeout=10)
    prefill.popen.send_signal(signal.SIGTERM)
    assert wait_until(lambda: not r.hexists("pdserve:workers", prefill.name), 10)
    assert worker_info(prefill.address).draining
    cluster.respawn(router)
    assert wait_until(lambda: _listed(cluster) == {"kept~0"}, 30)
    info = worker_info(prefill.address)  # still draining: "kept~0" is held
    assert info.num_leased == 1 and info.num_expired_leases == expired
    assert _release(prefill.address, "kept~0")
    assert prefill.popen.wait(timeout=60) == 0  # its drain ended with its last lease
    assert _listed(cluster) == set()
    assert not r.keys("pdserve:xfer:*") and not r.exists(f"pdserve:wxfers:{prefill.name}")
