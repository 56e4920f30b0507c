"""A Generate client that stops reading with its connection open: the router's write of its
next chunk waits for the client's HTTP/2 window for good. The decode worker finishes the
request and frees its blocks regardless, and other clients stream on; without a deadline the
router held the request (its output, its place among --max-inflight-requests) for ever.
--client-write-timeout-s now ends it (router/write_watch.py); the client reads the status
after the output it had not read."""
from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import common_pb2, router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, cluster_stats, random_prompts,
                                   stream_greedy, wait_all_blocks_free)

MODEL = SERVING_MODEL

WRITE_TIMEOUT_S = 3
MAX_TOKENS = 600  # with 20 logprobs a token, ~340 KB: far past a 64 KiB window


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, num_prefill=0, worker_args=WORKER_ARGS,
                       router_args=["--client-write-timeout-s", str(WRITE_TIMEOUT_S)])
    with Cluster(spec) as c:
        yield c


def _in_flight_drops_to_zero(router_address: str, timeout_s: float = 90.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cluster_stats(router_address).requests_in_flight == 0:
            return True
        time.sleep(0.2)
    return False


def test_a_client_that_stops_reading_has_its_call_cancelled(cluster):
    decode = [p.address for p in cluster.procs if p.name.startswith("decode")]
    prompts = random_prompts(2, seed=91, lo=20, hi=30)

    async def run():
        # BDP probing off: the client's window stays at HTTP/2's 64 KiB, as one whose reads
        # stopped before gRPC grew it (it grows to megabytes on a fast link).
        channel = grpc.aio.insecure_channel(cluster.router_address,
                                            options=[("grpc.http2.bdp_probe", 0)])
        call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
            token_ids=router_pb2.TokenIds(ids=prompts[0]),
            sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                               ignore_eos=True, logprobs=20)))
        first = await call.read()
        # Streamed beside it, read as it comes: never cut, never held up by the stalled one.
        reading = await asyncio.to_thread(stream_greedy, cluster.router_address, prompts[1:],
                                          [MAX_TOKENS])
        # Nothing read from the stalled call meanwhile: the router lets go of it all the same.
        dropped = await asyncio.to_thread(_in_flight_drops_to_zero, cluster.router_address)
        assert dropped, "the router still holds the request of a client that reads nothing"
        got = len(first.token_ids)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async with asyncio.timeout(60):  # a status that never came would hang it
                while (chunk := await call.read()) is not grpc.aio.EOF:
                    got += len(chunk.token_ids)
        await channel.close()
        return reading, got, err.value

    reading, got, err = asyncio.run(run())
    assert len(reading[0][0]) == MAX_TOKENS and reading[0][1].finish_reason == "length"
    # What the window and the buffers held, then the status, which says why.
    assert 0 < got < MAX_TOKENS
    assert err.code() == grpc.StatusCode.CANCELLED
    assert ("a chunk of its output waited 3 s for the client to take it "
            "(--client-write-timeout-s)") in err.details()
    wait_all_blocks_free(decode)


def test_a_client_whose_link_went_silent_is_cut_by_the_routers_pings(cluster):
    """A client whose host is gone with the connection open (the link goes silent mid-stream):
    it answers no ping, so the router cuts the connection and cancels the call within about
    --keepalive-time-s + --keepalive-timeout-s. Without the pings only the write timeout, set
    past this test's wait here (and 60 s by default), let go of it."""
    from tests.blackhole import Blackhole

    decode = [p.address for p in cluster.procs if p.name.startswith("decode")]
    router = cluster.start_router(extra=["--client-write-timeout-s", "600",
                                         "--keepalive-time-s", "0.3",
                                         "--keepalive-timeout-s", "0.3"])
    prompt = random_prompts(1, seed=92, lo=20, hi=30)[0]

    async def run():
        with Blackhole(router.address) as link:
            channel = grpc.aio.insecure_channel(link.address, options=[("grpc.http2.bdp_probe", 0)])
            call = router_pb2_grpc.RouterStub(channel).Generate(router_pb2.GenerateRequest(
                token_ids=router_pb2.TokenIds(ids=prompt),
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True, logprobs=20)))
            await call.read()
            link.freeze()
            dropped = await asyncio.to_thread(_in_flight_drops_to_zero, router.address, 30.0)
            call.cancel()
            await channel.close()
        return dropped

    try:
        assert asyncio.run(run()), "the router still holds the request of a vanished client"
        wait_all_blocks_free(decode)
    finally:
        assert cluster.stop_proc(router) == 0
