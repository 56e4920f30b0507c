"""A per-request Decode call cut before its first chunk, and the prefill lease behind it, through
real processes (Redis, router with ``--decode-stream per-request``, a prefill and a decode
worker).

The router cancels such a call a millisecond or two after opening it, usually before it reaches
the decode worker, and gRPC does not say whether it was sent: the decode worker may be reading
the prompt's KV, so the router's ReleaseKV leaves the lease to that reader (``may_be_read``).
A worker that never got the call sent no word either, and the blocks stayed held until the
lease expired (20 s of a 20 s lease, every time it was measured). The router now asks the
decode worker (ForgetLease): a lease it has not met is refused to any Decode call still to
come, and the router frees it at once."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from client import AsyncClient
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import WORKER_ARGS, random_prompts, wait_all_blocks_free, worker_info

LEASE_S = 60.0
_ARGS = [*WORKER_ARGS[:WORKER_ARGS.index("--kv-lease-timeout-s")], "--kv-lease-timeout-s",
         f"{LEASE_S:g}"]


@pytest.fixture(scope="module")
def cluster():
    with Cluster(ClusterSpec(worker_args=_ARGS,
                             router_args=["--max-local-prefill-length", "0",
                                          "--decode-stream", "per-request"])) as c:
        yield c


def _address(cluster, role: str) -> str:
    return next(p.address for p in cluster.procs if p.name.startswith(role))


async def _cut_after_first_token(client: AsyncClient, prompt: list[int], rid: str) -> None:
    chunks = client.generate(prompt, request_id=rid, max_tokens=800, temperature=0.0,
                             ignore_eos=True, timeout=120)
    await anext(chunks)  # the prefill's token: the router opens the Decode call next
    await chunks.aclose()  # the client's cancel


def test_a_per_request_decode_cut_after_the_first_token_frees_its_lease_before_expiry(cluster):
    prompts = random_prompts(8, seed=91, lo=20, hi=60)

    async def burst():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            for i, prompt in enumerate(prompts):  # one at a time: each cut is the first-token one
                await _cut_after_first_token(client, prompt, f"forget-{i}")

    asyncio.run(burst())
    # A lease left to its expiry fails this: a third of it is far more than any release takes.
    wait_all_blocks_free([_address(cluster, "prefill"), _address(cluster, "decode")],
                         timeout_s=LEASE_S / 3)


def test_a_decode_call_for_a_forgotten_lease_is_refused_and_reads_nothing(cluster):
    """The decode worker answers ForgetLease before the Decode call arrives (the order a cut
    call overtaken on the wire would take): the call is refused, and the prefill worker's lease
    stays held (a pull would have released it) until the router releases it."""
    prefill_address, decode_address = _address(cluster, "prefill"), _address(cluster, "decode")
    prompt = random_prompts(1, seed=92, lo=30, hi=30)[0]
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(prefill_address) as pch, \
            grpc.insecure_channel(decode_address) as dch:
        prefill = worker_pb2_grpc.PrefillWorkerStub(pch)
        decode = worker_pb2_grpc.DecodeWorkerStub(dch)
        presp = prefill.Prefill(worker_pb2.PrefillRequest(
            request_id="late-call", prompt_token_ids=prompt, sampling=sampling), timeout=60)
        lease_id = presp.kv_handle.lease_id
        assert worker_info(prefill_address).num_leased == 1
        answer = decode.ForgetLease(worker_pb2.ForgetLeaseRequest(
            lease_id=lease_id, lease_timeout_s=presp.kv_handle.lease_timeout_s), timeout=10)
        assert not answer.may_be_reading  # it never met the lease
        with pytest.raises(grpc.RpcError) as refused:
            list(decode.Decode(worker_pb2.DecodeRequest(
                request_id="late-call", prompt_token_ids=prompt,
                first_token_id=presp.first_token_id, sampling=sampling,
                kv_handle=presp.kv_handle), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "ForgetLease" in refused.value.details()
        info = worker_info(prefill_address)
        assert info.num_leased == 1  # not pulled: a pull's end releases the lease
        assert worker_info(decode_address).num_free_blocks \
            == worker_info(decode_address).num_total_blocks
        assert prefill.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id="late-call"),
                                 timeout=10).released
    wait_all_blocks_free([prefill_address, decode_address], timeout_s=10)
