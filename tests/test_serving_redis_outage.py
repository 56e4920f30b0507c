"""A Redis outage across real processes: the cluster keeps serving on the router's last view
while Redis hangs (SIGSTOP) or is gone (SIGKILL), and takes the registry and the prefix index
up again when a new Redis comes back on the same address: the workers republish their whole
prefix caches, so prefixes cached before the outage are found again."""
from __future__ import annotations

import signal

import grpc
import pytest
import redis as redis_client

from client import Client
from engine import SamplingParams
from engine.block_hash import hash_request_tokens
from protos import router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from router.redis_server import RedisServer
from tests.proc_signals import wait_until
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, random_prompts, stream_greedy,
                                   wait_all_blocks_free)

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _admin(cluster):
    return router_pb2_grpc.RouterAdminStub(grpc.insecure_channel(cluster.router_address))


def _matched(cluster) -> int:
    return _admin(cluster).GetClusterStats(router_pb2.ClusterStatsRequest(),
                                           timeout=30).prefix_tokens_matched


def _serves(cluster, reference, seed: int) -> None:
    prompts = random_prompts(4, seed=seed)
    want = reference.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    got = stream_greedy(cluster.router_address, prompts, [8] * 4)
    assert [toks for toks, _ in got] == [w.token_ids for w in want]


def _prefix_hit_routes(cluster) -> bool:
    """A fresh 96-token prefix, sent twice: whether the second request's routing found it in
    the Redis index (the router's prefix_tokens_matched grew)."""
    prefix = random_prompts(1, seed=len(cluster.procs) * 7 + _matched(cluster), lo=96, hi=96)[0]
    with Client(cluster.router_address, timeout=60) as c:
        c.complete(prefix + [5], max_tokens=2, **GREEDY)
        before = _matched(cluster)
        c.complete(prefix + [6], max_tokens=2, **GREEDY)
    return _matched(cluster) > before


def test_serving_survives_redis_hanging_dying_and_coming_back(cluster, reference):
    assert wait_until(lambda: _prefix_hit_routes(cluster), timeout_s=30)
    old_prefix = random_prompts(1, seed=99, lo=128, hi=128)[0]
    with Client(cluster.router_address, timeout=60) as c:
        c.complete(old_prefix + [5], max_tokens=2, **GREEDY)  # cached before the outage
    redis = cluster.redis
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        _serves(cluster, reference, seed=1)  # a hung Redis: the first read times out
        _serves(cluster, reference, seed=2)
        with pytest.raises(grpc.RpcError) as err:  # the registry itself is unreachable
            _admin(cluster).ListWorkers(router_pb2.ListWorkersRequest(), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        redis.proc.send_signal(signal.SIGCONT)
    port = redis.port
    redis.proc.kill()
    redis.proc.wait()
    _serves(cluster, reference, seed=3)  # Redis gone: connections refused
    assert _admin(cluster).GetClusterStats(router_pb2.ClusterStatsRequest(),
                                           timeout=30).num_decode_workers == 1
    # A new, empty Redis on the same address: the workers' heartbeats register them again,
    # their new blocks are indexed, and routing finds prefixes again.
    cluster.redis = RedisServer(port=port)

    def registered() -> bool:
        return len(_admin(cluster).ListWorkers(router_pb2.ListWorkersRequest(),
                                               timeout=30).workers) == 2

    assert wait_until(registered, timeout_s=30)
    # The decode worker republishes its cache too (the blocks it pulled before the outage),
    # which is how a chat's next turn finds its reply there (router/local_prefill.py).
    decode = next(p.name for p in cluster.procs if p.name.startswith("decode"))
    index = redis_client.Redis.from_url(cluster.redis.url)
    old_blocks = {h.hex().encode() for h in hash_request_tokens(old_prefix, 16)}
    assert wait_until(lambda: old_blocks <= index.smembers(f"pdserve:wblocks:{decode}"), 30)

    def old_prefix_routes() -> bool:
        before = _matched(cluster)
        with Client(cluster.router_address, timeout=60) as c:
            c.complete(old_prefix + [6], max_tokens=2, **GREEDY)
        return _matched(cluster) - before == 128  # its 8 full blocks, from the new index

    assert wait_until(old_prefix_routes, timeout_s=30)
    assert wait_until(lambda: _prefix_hit_routes(cluster), timeout_s=30)
    _serves(cluster, reference, seed=4)
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"])
