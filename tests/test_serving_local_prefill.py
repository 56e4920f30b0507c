"""Conditional disaggregation end to end: the decode worker prefills short prompts itself.

The router here sends every prompt of at most 64 tokens to local prefill (queue threshold 0),
longer ones through the prefill worker, so one cluster runs both paths deterministically.
"""
from __future__ import annotations

import asyncio

import grpc
import pytest

from client import (AsyncClient, Client, DeadlineExceededError, InvalidArgumentError,
                    UnavailableError)
from engine import SamplingParams
from protos import common_pb2, worker_pb2, worker_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, cluster_stats, decisive_prompts,
                                   random_prompts, stream_greedy, wait_all_blocks_free, worker_info)

MODEL = SERVING_MODEL

LOCAL_MAX = 64
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    # The other serving tests' routers use the default multiplexed decode stream; this one
    # keeps the per-request Decode calls covered (parity, cancel, deadline, errors).
    spec = ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", str(LOCAL_MAX),
                                    "--local-prefill-queue-threshold", "0",
                                    "--decode-stream", "per-request"])
    with Cluster(spec) as c:
        yield c


def _workers(cluster) -> list[str]:
    return [p.address for p in cluster.procs if p.name != "router"]


def _address(cluster, role: str) -> str:
    return next(p.address for p in cluster.procs if p.name.startswith(role))


def _decode_address(cluster) -> str:
    return _address(cluster, "decode")


def _check_parity(got, want, prompts) -> None:
    for (toks, final), w, p in zip(got, want, prompts):
        assert toks == w.token_ids
        assert final.finish_reason == "length"
        u = final.usage
        assert u.prompt_tokens == len(p) and u.completion_tokens == len(w.token_ids)
        assert u.local_prefill is (len(p) <= LOCAL_MAX)
        if u.local_prefill:
            assert u.prefill_worker_id == u.decode_worker_id
            assert u.decode_worker_id.startswith("decode-")
            assert u.timings.kv_transfer_s == 0.0
        else:
            assert u.prefill_worker_id.startswith("prefill-")
        assert u.timings.ttft_s > 0 and u.timings.e2e_s >= u.timings.ttft_s


def _run_matched(cluster, reference, prompts, max_tokens) -> tuple[int, int]:
    """Streams the prompts, checks them against the in-process engine and that every block is
    freed after; returns how many the router prefilled (locally, remotely)."""
    want = reference.generate(prompts, [SamplingParams(max_tokens=m, **GREEDY)
                                        for m in max_tokens])
    before = cluster_stats(cluster.router_address)
    got = stream_greedy(cluster.router_address, prompts, max_tokens)
    _check_parity(got, want, prompts)
    after = cluster_stats(cluster.router_address)
    wait_all_blocks_free(_workers(cluster))
    return (after.requests_prefilled_locally - before.requests_prefilled_locally,
            after.requests_prefilled_remotely - before.requests_prefilled_remotely)


def test_concurrent_local_prefill_streams_match_the_in_process_engine(cluster, reference):
    prompts = random_prompts(6, seed=31, lo=5, hi=LOCAL_MAX)
    max_tokens = [6 + (i * 5) % 9 for i in range(len(prompts))]
    assert _run_matched(cluster, reference, prompts, max_tokens) == (len(prompts), 0)


def test_mixed_local_and_remote_prefill_match_and_are_counted(cluster, reference):
    max_tokens = [5 + i % 4 for i in range(8)]
    prompts = decisive_prompts(reference, 8, seed=41, max_tokens=max_tokens, lo=20, hi=120)
    num_local = sum(len(p) <= LOCAL_MAX for p in prompts)
    assert 0 < num_local < len(prompts)  # the seed gives both kinds
    assert (_run_matched(cluster, reference, prompts, max_tokens)
            == (num_local, len(prompts) - num_local))


def test_text_stop_string_and_logprobs_through_local_prefill(cluster, reference):
    params = SamplingParams(max_tokens=10, **GREEDY, logprobs=2)
    want = reference.generate(["Once upon a time"], params)[0]
    with Client(cluster.router_address, timeout=60) as c:
        res = c.complete("Once upon a time", max_tokens=10, logprobs=2, **GREEDY)
    assert res.usage.local_prefill
    assert res.token_ids == want.token_ids and res.text == want.text
    assert [lp.sampled.token_id for lp in res.logprobs] == want.token_ids
    for a, b in zip(res.logprobs, want.logprobs):
        assert a.sampled.logprob == pytest.approx(b.sampled.logprob, abs=1e-4)


def test_prompt_logprobs_through_local_prefill(cluster, reference):
    from tests.serving_helpers import assert_same_logprobs

    params = SamplingParams(max_tokens=6, prompt_logprobs=3, **GREEDY)
    want = reference.generate(["Once upon a time in a land"], params)[0]
    with Client(cluster.router_address, timeout=60) as c:
        chunks = list(c.generate("Once upon a time in a land", max_tokens=6, prompt_logprobs=3,
                                 **GREEDY))
    assert chunks[-1].usage.local_prefill
    assert_same_logprobs(chunks[0].prompt_logprobs, want.prompt_logprobs)
    assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
    wait_all_blocks_free(_workers(cluster))


def test_local_prefill_reuses_the_decode_workers_prefix_cache(cluster):
    prompt = random_prompts(1, seed=51, lo=40, hi=40)[0]
    with Client(cluster.router_address, timeout=60) as c:
        first = c.complete(prompt, max_tokens=3, **GREEDY)
        again = c.complete(prompt, max_tokens=3, **GREEDY)
    assert first.usage.local_prefill and again.usage.local_prefill
    assert again.token_ids == first.token_ids
    assert again.usage.cached_tokens == 32  # two full blocks of 16; the tail is recomputed


def test_client_cancel_of_a_local_prefill_frees_every_block(cluster):
    before = cluster_stats(cluster.router_address)
    with Client(cluster.router_address, timeout=60) as c:
        stream = c.generate(random_prompts(1, seed=3, lo=30, hi=30)[0], max_tokens=400,
                            **GREEDY)
        got = [next(stream) for _ in range(3)]
        stream.close()  # cancels the call
    assert all(ch.finish_reason is None for ch in got)
    after = cluster_stats(cluster.router_address)
    assert after.requests_prefilled_locally == before.requests_prefilled_locally + 1
    wait_all_blocks_free(_workers(cluster))


def test_deadline_of_a_local_prefill_frees_every_block(cluster):
    # The rest of the context (WORKER_ARGS: 1024) takes micro-llama ~0.5 s in-process here.
    with Client(cluster.router_address) as c:
        with pytest.raises(DeadlineExceededError):
            for _ in c.generate(random_prompts(1, seed=4, lo=30, hi=30)[0], max_tokens=994,
                                timeout=0.25, **GREEDY):
                pass
    wait_all_blocks_free(_workers(cluster))


def _decode_direct(cluster, **fields) -> list[worker_pb2.DecodeChunk]:
    req = worker_pb2.DecodeRequest(request_id=fields.pop("request_id", "direct"),
                                   local_prefill=True, **fields)
    with grpc.insecure_channel(_decode_address(cluster)) as ch:
        return list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req, timeout=60))


def test_decode_worker_streams_the_first_token_of_a_local_prefill(cluster, reference):
    prompt = random_prompts(1, seed=61, lo=25, hi=25)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))[0]
    chunks = _decode_direct(cluster, prompt_token_ids=prompt,
                            sampling=common_pb2.SamplingParams(max_tokens=5, temperature=0.0,
                                                               ignore_eos=True))
    assert list(chunks[0].token_ids) == want.token_ids[:1]
    assert chunks[0].HasField("timings") and chunks[0].timings.kv_transfer_s == 0.0
    assert [t for c in chunks for t in c.token_ids] == want.token_ids
    assert chunks[-1].finish_reason == "length"
    wait_all_blocks_free(_workers(cluster))


def test_a_local_prefill_resumes_a_migrated_request(cluster, reference):
    """A continuation (router/migration.py) sent to a decode worker that prefills it itself:
    the prompt and the output so far are recomputed here, and the rest streams as it would
    have, text included."""
    prompt = random_prompts(1, seed=62, lo=40, hi=40)[0]
    want = reference.generate([prompt], SamplingParams(max_tokens=12, **GREEDY))[0]
    done = reference.generate([prompt], SamplingParams(max_tokens=5, **GREEDY))[0]
    chunks = _decode_direct(cluster, prompt_token_ids=prompt, resume_token_ids=done.token_ids,
                            sampling=common_pb2.SamplingParams(max_tokens=12, temperature=0.0,
                                                               ignore_eos=True))
    assert [t for c in chunks for t in c.token_ids] == want.token_ids[5:]
    assert done.text + "".join(c.text_delta for c in chunks) == want.text
    assert chunks[-1].finish_reason == "length"
    wait_all_blocks_free(_workers(cluster))


@pytest.mark.parametrize("fields, match", [
    ({"kv_handle": common_pb2.KVHandle(worker_id="p0")}, "must not carry a kv_handle"),
    ({"kv_handle": common_pb2.KVHandle()}, "must not carry a kv_handle"),
    ({"first_token_id": 5}, "must not carry a first_token_id"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": [1, 99999999]}, "outside the vocabulary"),
    ({"request_id": ""}, "request_id is empty"),
    ({"resume_token_ids": [4, 99999999]}, "outside the vocabulary"),
    ({"resume_token_ids": [-4]}, "resume token id -4 is out of range"),
    ({"resume_token_ids": [4] * 16}, "leave nothing to generate"),
])
def test_bad_local_prefill_requests_get_invalid_argument(cluster, fields, match):
    fields.setdefault("prompt_token_ids", [1, 2, 3])
    with pytest.raises(grpc.RpcError) as err:
        _decode_direct(cluster, **fields)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in err.value.details()
    wait_all_blocks_free(_workers(cluster))


# The slow tier: a decode worker prefilling with no prefill worker up is the aggregated
# cluster's case below; what this adds is the refusal of a longer prompt once the last one left.
@pytest.mark.slow
def test_without_a_prefill_worker_short_prompts_are_prefilled_on_the_decode_worker(reference):
    # The default threshold (2): with a prefill worker up, an idle one would take the prompt.
    spec = ClusterSpec(model=MODEL, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", str(LOCAL_MAX)])
    with Cluster(spec) as c:
        prefill = next(p for p in c.procs if p.name.startswith("prefill"))
        assert c.stop_proc(prefill) == 0
        c.wait_routable(0, 1)
        short = random_prompts(3, seed=71, lo=10, hi=LOCAL_MAX)
        want = reference.generate(short, SamplingParams(max_tokens=6, **GREEDY))
        got = stream_greedy(c.router_address, short, [6] * len(short))
        for (toks, final), w in zip(got, want):
            assert toks == w.token_ids and final.usage.local_prefill
        with Client(c.router_address, timeout=60) as client:
            with pytest.raises(UnavailableError, match="longer than a decode worker prefills"):
                client.complete(random_prompts(1, seed=72, lo=LOCAL_MAX + 1, hi=100)[0],
                                max_tokens=2, **GREEDY)
        wait_all_blocks_free([p.address for p in c.procs if p.name.startswith("decode")])


def test_an_aggregated_cluster_serves_every_prompt_on_its_decode_worker(reference):
    """``num_prefill=0``: no prefill worker, and the launcher lifts the local-prefill limit to
    the model's context, so prompts several steps long are prefilled (in chunks) by the decode
    worker and match the in-process engine."""
    spec = ClusterSpec(model=MODEL, num_prefill=0,
                       worker_args=[*WORKER_ARGS, "--max-num-batched-tokens", "96"])
    with Cluster(spec) as c:
        assert [p.name.split("-")[0] for p in c.procs] == ["decode", "router"]
        prompts = random_prompts(6, seed=73, lo=40, hi=250)
        assert max(map(len, prompts)) > 2 * 96  # several chunked steps, past LOCAL_MAX too
        lens = [5, 9, 3, 12, 7, 4]
        want = reference.generate(prompts, [SamplingParams(max_tokens=n, **GREEDY)
                                            for n in lens])
        got = stream_greedy(c.router_address, prompts, lens)
        for (toks, final), w, p in zip(got, want, prompts):
            assert toks == w.token_ids
            u = final.usage
            assert u.local_prefill and u.prompt_tokens == len(p)
            assert u.prefill_worker_id == u.decode_worker_id
        assert len({tuple(w.token_ids) for w in want}) == len(want)  # not one repeated token
        stats = cluster_stats(c.router_address)
        assert (stats.num_prefill_workers, stats.num_decode_workers) == (0, 1)
        # Past the workers' context (--max-model-len 1024): refused as a bad request.
        with Client(c.router_address, timeout=60) as client:
            with pytest.raises(InvalidArgumentError, match="max_model_len"):
                client.complete(random_prompts(1, seed=74, lo=1100, hi=1100)[0], max_tokens=2,
                                **GREEDY)
        wait_all_blocks_free([p.address for p in c.procs if p.name.startswith("decode")])
        # Scaling out: a prefill worker joins the running cluster, nothing restarts, and an
        # idle prefill worker takes the next new prompt (the local-prefill balancing rule).
        c.add_worker("prefill")
        c.wait_routable(1, 1)
        fresh = random_prompts(1, seed=75, lo=120, hi=120)
        [(toks, final)] = stream_greedy(c.router_address, fresh, [6])
        assert toks == reference.generate(fresh, SamplingParams(max_tokens=6, **GREEDY))[0].token_ids
        assert not final.usage.local_prefill
        assert final.usage.prefill_worker_id.startswith("prefill-")
        # A prompt the decode worker already holds stays there (its cache, not load).
        [(toks, final)] = stream_greedy(c.router_address, prompts[:1], lens[:1])
        assert toks == want[0].token_ids
        assert final.usage.local_prefill and final.usage.cached_tokens >= 64
        wait_all_blocks_free(_workers(c))


# A per-request Decode call cut before its first chunk, and the prefill lease behind it (prompts
# longer than LOCAL_MAX go through the prefill worker). The router cancels such a call a
# millisecond or two after opening it, usually before it reaches the decode worker, and gRPC
# does not say whether it was sent: the decode worker may be reading the prompt's KV, so the
# router's ReleaseKV leaves the lease to that reader (``may_be_read``). A worker that never got
# the call sent no word either, and the blocks stayed held until the lease expired (20 s of a
# 20 s lease, every time it was measured). The router now asks the decode worker (ForgetLease):
# a lease it has not met is refused to any Decode call still to come, and the router frees it.


async def _cut_after_first_token(client: AsyncClient, prompt: list[int], rid: str) -> None:
    chunks = client.generate(prompt, request_id=rid, max_tokens=800, temperature=0.0,
                             ignore_eos=True, timeout=120)
    await anext(chunks)  # the prefill's token: the router opens the Decode call next
    await chunks.aclose()  # the client's cancel


def test_a_per_request_decode_cut_after_the_first_token_frees_its_lease_before_expiry(cluster):
    prompts = random_prompts(8, seed=91, lo=LOCAL_MAX + 6, hi=LOCAL_MAX + 60)

    async def burst():
        async with AsyncClient(cluster.router_address, timeout=120) as client:
            for i, prompt in enumerate(prompts):  # one at a time: each cut is the first-token one
                await _cut_after_first_token(client, prompt, f"forget-{i}")

    asyncio.run(burst())
    # A lease left to its expiry fails this: a third of it is far more than any release takes.
    wait_all_blocks_free([_address(cluster, "prefill"), _address(cluster, "decode")],
                         timeout_s=20.0 / 3)


def test_a_decode_call_for_a_forgotten_lease_is_refused_and_reads_nothing(cluster):
    """The decode worker answers ForgetLease before the Decode call arrives (the order a cut
    call overtaken on the wire would take): the call is refused, and the prefill worker's lease
    stays held (a pull would have released it) until the router releases it."""
    prefill_address, decode_address = _address(cluster, "prefill"), _address(cluster, "decode")
    prompt = random_prompts(1, seed=92, lo=LOCAL_MAX + 10, hi=LOCAL_MAX + 10)[0]
    sampling = common_pb2.SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(prefill_address) as pch, \
            grpc.insecure_channel(decode_address) as dch:
        prefill = worker_pb2_grpc.PrefillWorkerStub(pch)
        decode = worker_pb2_grpc.DecodeWorkerStub(dch)
        presp = prefill.Prefill(worker_pb2.PrefillRequest(
            request_id="late-call", prompt_token_ids=prompt, sampling=sampling), timeout=60)
        lease_id = presp.kv_handle.lease_id
        assert worker_info(prefill_address).num_leased == 1
        before = worker_info(decode_address)
        answer = decode.ForgetLease(worker_pb2.ForgetLeaseRequest(
            lease_id=lease_id, lease_timeout_s=presp.kv_handle.lease_timeout_s), timeout=10)
        assert not answer.may_be_reading  # it never met the lease
        after = worker_info(decode_address)  # counted by answer, for the worker's metrics
        assert (after.leases_forgotten - before.leases_forgotten,
                after.leases_forget_reading - before.leases_forget_reading,
                after.leases_forget_no_room - before.leases_forget_no_room) == (1, 0, 0)
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
