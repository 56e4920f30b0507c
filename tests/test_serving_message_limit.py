"""gRPC's message limit (``PDSERVE_MAX_MESSAGE_BYTES``, protos/limits.py) on the request path.

A prefill answer carries the prompt's logprobs, ~440 bytes a prompt token at 20 of them; gRPC
refuses to send one over the limit with RESOURCE_EXHAUSTED, which the router reads as "the
worker never took the request" and so releases nothing, while the worker had leased the
prompt's blocks. The prefill worker now refuses such an answer itself and frees its lease."""
from __future__ import annotations

import pytest

from client import Client, InvalidArgumentError
from protos.limits import ENV, MIN_MESSAGE_BYTES, max_message_bytes, message_size_options
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import random_prompts, wait_all_blocks_free

LIMIT = 128 * 1024
# Leases far longer than the wait below: blocks that come back came back through a release.
_ARGS = ["--num-gpu-blocks", "128", "--max-model-len", "1024", "--heartbeat-interval-s", "0.3",
         "--kv-lease-timeout-s", "300"]


def test_the_limit_is_validated():
    assert max_message_bytes({}) == 64 * 1024 * 1024
    assert max_message_bytes({ENV: " 200000 "}) == 200000
    assert message_size_options({ENV: "200000"}) == [("grpc.max_send_message_length", 200000),
                                                     ("grpc.max_receive_message_length", 200000)]
    for bad in ("64k", "1.5e6", str(MIN_MESSAGE_BYTES - 1), str(2**31), "-1"):
        with pytest.raises(ValueError, match=ENV):
            max_message_bytes({ENV: bad})


@pytest.fixture(scope="module")
def cluster():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(ENV, str(LIMIT))  # every process of the cluster inherits it
        with Cluster(ClusterSpec(worker_args=_ARGS,
                                 router_args=["--max-local-prefill-length", "0"])) as c:
            yield c


def test_an_answer_over_the_limit_is_refused_and_its_lease_freed(cluster, monkeypatch):
    monkeypatch.setenv(ENV, str(LIMIT))
    workers = [p.address for p in cluster.procs if p.name != "router"]
    prompt = random_prompts(1, seed=5, lo=600, hi=600)[0]
    with Client(cluster.router_address, timeout=120) as c:
        with pytest.raises(InvalidArgumentError, match="message limit.*prompt_logprobs=20"):
            c.complete(prompt, max_tokens=4, prompt_logprobs=20)
        wait_all_blocks_free(workers, timeout_s=30)
        # Within the limit the same prompt is served, its logprobs and all.
        res = c.complete(prompt, max_tokens=4, prompt_logprobs=0, temperature=0.0)
        assert len(res.prompt_logprobs) == len(prompt) and len(res.token_ids) == 4
    wait_all_blocks_free(workers, timeout_s=30)
