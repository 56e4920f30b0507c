"""On a GPU: `pdserve up`'s cluster with a prefill and a decode worker sharing one GPU (each
0.45 of it), KV over NIXL's CUDA path, greedy tokens equal the in-process engine's on the same
GPU. Needs CUDA, redis-server and nixl (the device machine lacks nixl unless carried)."""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import random_prompts, stream_greedy, worker_info

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("engine_process", [False, True], ids=["engine-thread", "engine-process"])
def test_one_gpu_serves_a_prefill_and_a_decode_worker(engine_process):
    """With the engine in the worker and in a process of its own (the default on GPUs; then
    each worker's CUDA context, KV cache and NIXL agent are its engine process's)."""
    pytest.importorskip("nixl")
    spec = ClusterSpec(worker_args=["--dtype", "float32", "--max-model-len", "1024",
                                    "--heartbeat-interval-s", "0.3"],
                       router_args=["--max-local-prefill-length", "0"], gpus=("0",),
                       engine_process=engine_process)
    prompts = random_prompts(6, seed=3)
    with Cluster(spec) as cluster:
        workers = [p for p in cluster.procs if p.role != "router"]
        assert sorted((p.role, p.gpus.visible_devices, p.gpus.gpu_memory_utilization)
                      for p in workers) == [("decode", "0", 0.45), ("prefill", "0", 0.45)]
        # Equal shares: neither sized its cache from what the other had left.
        blocks = [worker_info(p.address).num_total_blocks for p in workers]
        assert min(blocks) > 0.95 * max(blocks)
        # One at a time, as the reference runs them: the same batch shapes, the same kernels.
        got = [stream_greedy(cluster.router_address, [p], [24])[0][0] for p in prompts]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM("tiny-llama", dtype="float32", num_gpu_blocks=512) as ref:
        want = [ref.generate([p], params)[0].token_ids for p in prompts]
    assert len({tuple(w) for w in want}) == len(prompts)  # diverse, not one repeated output
    assert got == want
