"""The serving path with `--kv-transfer-backend torch`: real processes, KV over a gloo pair
group per prefill/decode pair instead of NIXL; greedy tokens equal the in-process engine's."""
from __future__ import annotations

from engine import SamplingParams
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, decisive_prompts, stream_greedy,
                                   wait_all_blocks_free, worker_info)

MODEL = SERVING_MODEL


def test_streams_over_the_torch_backend_match_the_in_process_engine(reference):
    max_tokens = [12 + (i * 5) % 11 for i in range(10)]
    prompts = decisive_prompts(reference, 10, seed=23, max_tokens=max_tokens)
    want = reference.generate(prompts, [SamplingParams(max_tokens=m, temperature=0.0,
                                                       ignore_eos=True) for m in max_tokens])
    spec = ClusterSpec(model=MODEL, kv_transfer_backend="torch", worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as cluster:
        workers = [p.address for p in cluster.procs if p.role != "router"]
        assert {worker_info(a).kv_transfer_backend for a in workers} == {"torch"}
        got = stream_greedy(cluster.router_address, prompts, max_tokens)
        wait_all_blocks_free(workers)  # every lease released over the torch path too
    assert len({tuple(w.token_ids) for w in want}) > 5
    for (toks, final), w in zip(got, want):
        assert toks == w.token_ids
        assert final.usage.timings.kv_transfer_s > 0  # the KV really moved between workers
