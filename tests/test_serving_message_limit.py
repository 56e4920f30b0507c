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
from tests.serving_helpers import (SERVING_MODEL, free_port, parse_metrics, random_prompts, scrape,
                                   wait_all_blocks_free)

MODEL = SERVING_MODEL

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
        port = free_port()
        with Cluster(ClusterSpec(model=MODEL, worker_args=_ARGS,
                                 router_args=["--max-local-prefill-length", "0",
                                              "--metrics-port", str(port)])) as c:
            c.metrics_port = port
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


def test_an_answer_just_under_the_limit_leaves_room_for_what_the_router_adds(cluster,
                                                                           monkeypatch):
    """The router passes a prefill answer on with its request id, usage and the model's
    identity: one that fitted the worker's message, by a few hundred bytes, did not fit the
    router's (RESOURCE_EXHAUSTED to a client that asked for nothing wrong)."""
    from client import ResourceExhaustedError

    monkeypatch.setenv(ENV, str(LIMIT))
    # ~15 tokens under where the workers refuse these prompts (249 and 250 tokens, 8 KiB under
    # the limit; further on without that room): every length from here up to there is served.
    start = 235
    with Client(cluster.router_address, timeout=120) as c:
        for seed in (103, 109):  # prompts whose answers came that close
            base = random_prompts(1, seed=seed, lo=320, hi=320)[0]
            served = 0
            for n in range(start, 320):
                try:
                    list(c.generate(base[:n], max_tokens=1, prompt_logprobs=20,
                                    temperature=0.0))
                    served += 1
                except ResourceExhaustedError as e:
                    pytest.fail(f"{n} prompt tokens: {e}")
                except InvalidArgumentError as e:
                    assert "message limit" in str(e)
                    break
            assert 0 < served < 320 - start


def test_a_whole_answer_over_the_limit_is_refused_by_name_and_streams_whole(cluster,
                                                                           monkeypatch):
    """Complete sums the chunks: each fits a message, all of them with logprobs need not, and
    gRPC's refusal reached the client as RESOURCE_EXHAUSTED ("busy: try later"). The refused
    one counted as finished in the router's metrics, though its caller got an error."""
    monkeypatch.setenv(ENV, str(LIMIT))
    prompt = random_prompts(1, seed=11, lo=20, hi=20)[0]
    args = dict(max_tokens=400, logprobs=20, temperature=0.0, ignore_eos=True)
    with Client(cluster.router_address, timeout=120) as c:
        before = _outcomes(cluster)
        with pytest.raises(InvalidArgumentError, match="whole answer .* stream it with Generate"):
            c.complete(prompt, **args)
        # It ended with an error status: failed, not finished (it was, before the refusal).
        assert _outcomes(cluster) == (before[0] + 1, before[1])
        chunks = list(c.generate(prompt, **args))
        assert _outcomes(cluster) == (before[0] + 1, before[1] + 1)
        assert sum(len(ch.token_ids) for ch in chunks) == 400
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], 30)


def _outcomes(cluster) -> tuple[float, float]:
    """The router's (failed, finished with reason "length") request counts."""
    m = parse_metrics(scrape(cluster.metrics_port)[2])
    length = frozenset({("finish_reason", "length")})
    return (sum(v for (name, _), v in m.items() if name == "pdserve_router_requests_failed_total"),
            m.get(("pdserve_router_requests_finished_total", length), 0.0))


def test_decode_chunks_over_the_limit_are_refused_and_a_batch_is_split_under_it(cluster):
    """A local prefill's first chunk carries its prompt_logprobs: one over the limit is refused
    (INVALID_ARGUMENT, its blocks freed), not sent for gRPC to refuse; chunks that fit alone
    but not together in one DecodeMany batch go out in several, and no request on the stream
    fails for another's size."""
    import asyncio

    import grpc

    from protos import common_pb2, worker_pb2_grpc
    from tests.decode_stream import DecodeStream, ended, local_request, start

    decode = next(p.address for p in cluster.procs if p.name.startswith("decode"))
    sampling = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                         prompt_logprobs=20)
    fits = random_prompts(3, seed=7, lo=110, hi=110)  # ~48 KB of prompt logprobs each
    too_big = random_prompts(1, seed=8, lo=600, hi=600)[0]

    def req(rid, prompt):
        r = local_request(rid, prompt, 3)
        r.sampling.CopyFrom(sampling)
        return r

    with grpc.insecure_channel(decode, options=message_size_options({ENV: str(LIMIT)})) as ch:
        with pytest.raises(grpc.RpcError) as err:
            list(worker_pb2_grpc.DecodeWorkerStub(ch).Decode(req("big", too_big), timeout=60))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "message" in err.value.details()

    async def run():
        s = DecodeStream(decode)
        for i, p in enumerate(fits):
            s.send(start(req(f"fit{i}", p)))
        s.send(start(req("big", too_big)))
        s.close_sending()
        by_rid = await s.read_until(lambda _: False)
        await s.close()
        return s.batches, by_rid

    batches, by_rid = asyncio.run(run())
    assert all(b.ByteSize() <= LIMIT for b in batches)
    assert by_rid["big"][-1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for i in range(3):
        events = by_rid[f"fit{i}"]
        assert ended(events) and events[-1].chunk.finish_reason == "length"
        assert len(events[0].chunk.prompt_logprobs) == 109  # the first prompt token has none
    wait_all_blocks_free([p.address for p in cluster.procs if p.name != "router"], timeout_s=30)


def test_a_decode_batch_over_the_limit_is_split_in_order(monkeypatch):
    from decode_svc import mux
    from protos import worker_pb2

    monkeypatch.setattr(mux, "_message_limit", lambda: MIN_MESSAGE_BYTES)
    batch = worker_pb2.DecodeBatch()
    for i in range(7):
        ev = batch.events.add(request_id=f"r{i}")
        ev.chunk.text_delta = "x" * (20_000 + 1000 * i)
    parts = mux._within_message_limit(batch)
    assert len(parts) > 1 and all(p.ByteSize() <= MIN_MESSAGE_BYTES for p in parts)
    assert [ev.request_id for p in parts for ev in p.events] == [f"r{i}" for i in range(7)]
    small = worker_pb2.DecodeBatch()
    small.events.add(request_id="s").chunk.token_ids.append(5)
    assert mux._within_message_limit(small) == [small]


def test_the_largest_chunk_a_decode_worker_sends_fits_a_batch_with_the_longest_id():
    """The room left for a chunk assumed its request's id was at most 1024 bytes: an id of
    1024 characters may be four times that in UTF-8, and its event then went past the
    limit, failing the stream of every request on it."""
    from decode_svc.mux import EVENT_ROOM_BYTES
    from protos import worker_pb2
    from protos.convert import MAX_WORKER_REQUEST_ID_CHARS, check_request_id

    room = MIN_MESSAGE_BYTES - EVENT_ROOM_BYTES
    chunk = worker_pb2.DecodeChunk(text_delta="x" * room)
    while chunk.ByteSize() > room:
        chunk.text_delta = chunk.text_delta[:-1]
    assert chunk.ByteSize() == room
    longest = check_request_id("\U0001F600" * MAX_WORKER_REQUEST_ID_CHARS)
    batch = worker_pb2.DecodeBatch()
    batch.events.add(request_id=longest).chunk.CopyFrom(chunk)
    assert batch.ByteSize() <= MIN_MESSAGE_BYTES
