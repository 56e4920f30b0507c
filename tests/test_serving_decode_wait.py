"""A decode worker without room for a burst of prefilled prompts: the router waits for room
while the prefill lease holds the KV (router/decode_wait.py), instead of ending streams that
have their first token. Real processes: redis, a prefill worker, a decode worker with a small
cache, and two routers (one that waits, one that does not)."""
from __future__ import annotations

import asyncio

import pytest

from client import AsyncClient, ResourceExhaustedError
from engine import LLM, SamplingParams
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import (SERVING_MODEL, cluster_stats, random_prompts, stream_greedy,
                                   wait_all_blocks_free)

MODEL = SERVING_MODEL

MAX_TOKENS = 24
# 24 blocks of 16 tokens: room for two of these prompts (100-150 tokens, plus output) at once.
DECODE_BLOCKS = 24


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, num_prefill=1, num_decode=1,
                       worker_args=["--max-model-len", "384", "--heartbeat-interval-s", "0.3",
                                    "--kv-lease-timeout-s", "20"],
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        # The spec's flags are every worker's: the decode worker with the small cache
        # replaces the spec's.
        for p in [p for p in c.procs if p.name.startswith("decode")]:
            c.stop_proc(p)
        c.add_worker("decode", extra=["--num-gpu-blocks", str(DECODE_BLOCKS)])
        c.wait_routable(1, 1)
        yield c


def _workers(cluster) -> list[str]:
    return [p.address for p in cluster.procs if not p.name.startswith("router")]


def test_a_burst_past_the_decode_workers_room_waits_and_matches_the_engine(cluster):
    prompts = random_prompts(8, seed=41, lo=100, hi=150)
    got = stream_greedy(cluster.router_address, prompts, [MAX_TOKENS] * len(prompts))
    with LLM(MODEL, num_gpu_blocks=256) as ref:
        want = ref.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                    ignore_eos=True))
    assert [toks for toks, _ in got] == [w.token_ids for w in want]
    assert len({tuple(w.token_ids) for w in want}) == len(want)  # not one repeated output
    assert all(final.finish_reason == "length" for _, final in got)
    # Eight prompts of 7-10 blocks each reached a 24-block worker together: some waited.
    assert cluster_stats(cluster.router_address).decode_waits > 0
    waited = [final.usage.timings.decode_queue_s for _, final in got]
    assert max(waited) > 0
    wait_all_blocks_free(_workers(cluster))


def test_without_waiting_a_refusal_reaches_the_client_and_frees_every_block(cluster):
    address = cluster.router_address
    router = cluster.start_router(extra=["--decode-wait-timeout-s", "0"])
    cluster.router_address = address
    prompts = random_prompts(8, seed=42, lo=100, hi=150)

    async def one(client, prompt):
        toks = []
        try:
            async for chunk in client.generate(prompt, max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True):
                toks += chunk.token_ids
        except ResourceExhaustedError as e:
            return toks, e
        return toks, None

    async def burst():
        async with AsyncClient(router.address, timeout=120) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    try:
        outcomes = asyncio.run(burst())
        refused = [(toks, e) for toks, e in outcomes if e is not None]
        served = [toks for toks, e in outcomes if e is None]
        assert refused and served
        assert all(len(toks) == MAX_TOKENS for toks in served)
        # Refused after their prefill: the client had the first token, and nothing more.
        assert all(len(toks) == 1 and "no room" in str(e) for toks, e in refused)
        assert cluster_stats(router.address).decode_waits == 0
        # The refused prompts' prefill leases were released, not left to expire (20 s).
        wait_all_blocks_free(_workers(cluster), timeout_s=10)
    finally:
        cluster.stop_proc(router)
