"""A decode worker's first pull from a prefill worker while Redis is down, across real
processes: the key that verifies the prefill worker's KV handles was read, with the handles,
when the decode worker connected to it ahead (engine/kv_peers.py), so the request is served
where it was sent. It was moved from prefill worker to prefill worker on the same refusal
("could not read prefill worker ...'s KV handles from the registry") until its migrations were
spent, and failed UNAVAILABLE: found by a chaos soak, where a decode worker started again just
before Redis did failed every request for a second."""
from __future__ import annotations

import pytest

from client import Client
from engine import SamplingParams
from router.launcher import Cluster, ClusterSpec
from router.redis_server import RedisServer
from tests.proc_signals import wait_until
from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts, worker_info

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def test_a_first_pull_while_redis_is_down_is_served(cluster, reference):
    decode = next(p for p in cluster.procs if p.role == "decode")
    # Connected ahead to the prefill worker; no request has pulled from it yet.
    assert wait_until(lambda: worker_info(decode.address).kv_peers_connected == 1, 30)
    prompts = random_prompts(2, seed=11)
    want = reference.generate(prompts, SamplingParams(max_tokens=8, **GREEDY))
    redis = cluster.redis
    redis.proc.kill()
    redis.proc.wait()
    try:
        with Client(cluster.router_address, timeout=60) as c:
            got = [c.complete(p, max_tokens=8, **GREEDY) for p in prompts]
        assert [g.token_ids for g in got] == [w.token_ids for w in want]
        assert [(g.usage.migrations, g.usage.local_prefill) for g in got] == [(0, False)] * 2
    finally:
        cluster.redis = RedisServer(port=redis.port)
