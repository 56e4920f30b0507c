"""The SDK's router failover: the retry policy on its own, then real routers in front of one
cluster: one SIGKILLed under running streams, one hung, and one of another chat template that a
stream begun elsewhere must not go on on."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import grpc
import pytest

from bench.greedy import greedy_is_decisive
from client import AsyncClient, FailoverPolicy
from client.failover import (MIGRATIONS_SPENT_KEY, MODEL_MISMATCH_KEY, Attempts, attempt_request,
                             check_addresses, take_chunk)
from engine import SamplingParams
from protos import common_pb2, router_pb2, router_pb2_grpc
from router.launcher import Cluster, ClusterSpec
from tests.serving_helpers import (SERVING_MODEL, WORKER_ARGS, decisive_outputs,
                                   wait_all_blocks_free)

MODEL = SERVING_MODEL

GREEDY = dict(temperature=0.0, ignore_eos=True)


class _Failed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code


UNAVAILABLE = _Failed(grpc.StatusCode.UNAVAILABLE)


def test_one_router_is_retried_after_a_growing_pause():
    tries = Attempts(FailoverPolicy(max_retries=3, backoff_s=0.5), 1, 0, None)
    assert [tries.after(UNAVAILABLE) for _ in range(4)] == [0.5, 1.0, 2.0, None]
    assert tries.router == 0


@pytest.mark.parametrize("backoff_s", [0.0, 0.5])
def test_a_client_that_retries_for_good_keeps_pausing_at_the_longest(backoff_s):
    """backoff_s * 2 ** rounds outgrew a float after 1023 rounds: OverflowError escaped."""
    policy = FailoverPolicy(max_retries=10**6, backoff_s=backoff_s, max_backoff_s=4.0)
    tries = Attempts(policy, 1, 0, None)
    pauses = [tries.after(UNAVAILABLE) for _ in range(1100)]
    assert pauses[:4] == ([0.0] * 4 if backoff_s == 0 else [0.5, 1.0, 2.0, 4.0])
    assert set(pauses[4:]) == {4.0 if backoff_s else 0.0}


def test_the_next_router_is_tried_at_once_then_the_round_starts_over_after_a_pause():
    tries = Attempts(FailoverPolicy(max_retries=4, backoff_s=0.5), 2, 1, None)
    seen = []
    for _ in range(4):
        seen.append((tries.after(UNAVAILABLE), tries.router))
    assert seen == [(0.0, 0), (0.5, 1), (0.0, 0), (1.0, 1)]


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED,
                                  grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.CANCELLED])
def test_only_unavailable_is_retried(code):
    assert Attempts(FailoverPolicy(), 2, 0, None).after(_Failed(code)) is None


def test_no_pause_outlasts_the_deadline_and_no_retries_means_none():
    assert Attempts(FailoverPolicy(backoff_s=0.5), 1, 0, 0.2).after(UNAVAILABLE) is None
    assert Attempts(FailoverPolicy(max_retries=0), 2, 0, None).after(UNAVAILABLE) is None


@pytest.mark.parametrize("make", [
    lambda md: grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                                    grpc.aio.Metadata(*md), "worker gone"),
    lambda md: _Trailed(grpc.StatusCode.UNAVAILABLE, md)])  # as a blocking call's error
def test_a_request_whose_migrations_are_spent_is_not_started_over(make):
    # Another attempt would be a new request on the router, with a whole new budget.
    spent = make(((MIGRATIONS_SPENT_KEY, "1"),))
    assert Attempts(FailoverPolicy(), 2, 0, None).after(spent) is None
    assert Attempts(FailoverPolicy(), 2, 0, None).after(make(())) == 0.0


class _Trailed(_Failed):
    def __init__(self, code: grpc.StatusCode, trailing: tuple) -> None:
        super().__init__(code)
        self._trailing = trailing

    def trailing_metadata(self) -> tuple:
        return self._trailing


def test_a_continuation_carries_what_arrived_under_its_own_id():
    req = router_pb2.GenerateRequest(request_id="abc")
    req.token_ids.ids.extend([1, 2])
    assert attempt_request(req, [9], 0) is req
    again = attempt_request(req, [7, 8], 2)
    assert list(again.resume_token_ids) == [7, 8] and again.request_id == "abc~r2"
    assert list(again.token_ids.ids) == [1, 2] and not req.resume_token_ids
    # The longest id the router takes stays within its limit with the suffix.
    from router.inflight import MAX_REQUEST_ID_CHARS, check_request_id
    longest = router_pb2.GenerateRequest(request_id="x" * MAX_REQUEST_ID_CHARS)
    again = attempt_request(longest, [], 12)
    assert again.request_id.endswith("x~r12") and check_request_id(again.request_id)


def test_a_router_of_another_model_is_skipped_for_the_rest_of_the_stream():
    foreign = _Trailed(grpc.StatusCode.FAILED_PRECONDITION, ((MODEL_MISMATCH_KEY, "1"),))
    tries = Attempts(FailoverPolicy(max_retries=5, backoff_s=0.5), 3, 0, None)
    assert (tries.after(UNAVAILABLE), tries.router) == (0.0, 1)
    assert (tries.after(foreign), tries.router) == (0.0, 2)
    # Round two skips router 1: 0, then 2, never 1.
    assert (tries.after(UNAVAILABLE), tries.router) == (0.5, 0)
    assert (tries.after(UNAVAILABLE), tries.router) == (0.0, 2)
    # Router 0 only failed (it may come back): the stream goes on trying it, after a pause
    # (the round 0, 2 is over).
    assert (tries.after(foreign), tries.router) == (1.0, 0)
    # Moves are the failures: a refusal of the model ran nothing there.
    assert (tries.retries, tries.moves) == (5, 3)


def test_client_moves_count_in_every_sequences_migrations():
    from client.types import completion_from_proto

    usage = router_pb2.Usage(completion_tokens=1, migrations=1)  # the router moved one
    choices = [router_pb2.Choice(index=i, token_ids=[i], finish_reason="length",
                                 usage=router_pb2.Usage(completion_tokens=1,
                                                        migrations=int(i == 0)))
               for i in range(3)]
    done = completion_from_proto(router_pb2.CompleteResponse(choices=choices, usage=usage),
                                 moves=2)
    # Each sequence moved twice with the request, and the request sums them, as the router's
    # total (router/parallel.py request_usage) sums its own.
    assert [c.usage.migrations for c in done.choices] == [3, 2, 2]
    assert done.usage.migrations == 7 == sum(c.usage.migrations for c in done.choices)
    one = completion_from_proto(router_pb2.CompleteResponse(
        token_ids=[5], finish_reason="length", usage=router_pb2.Usage(migrations=1)), moves=2)
    assert one.usage.migrations == one.choices[0].usage.migrations == 3


def test_a_router_of_another_model_does_not_cut_the_pauses_short():
    """Two routers, the stream's own restarting and the other serving another model: the
    retries of the first pause 0.5, 1, 2 s, as a lone router's do (every other one was at
    once: the skipped router counted as tried)."""
    foreign = _Trailed(grpc.StatusCode.FAILED_PRECONDITION, ((MODEL_MISMATCH_KEY, "1"),))
    tries = Attempts(FailoverPolicy(max_retries=4, backoff_s=0.5), 2, 1, None)
    assert (tries.after(UNAVAILABLE), tries.router) == (0.0, 0)
    assert (tries.after(foreign), tries.router) == (0.5, 1)
    assert [(tries.after(UNAVAILABLE), tries.router) for _ in range(3)] == \
        [(1.0, 1), (2.0, 1), (None, 1)]


def test_a_stream_ends_once_every_router_refused_its_model():
    foreign = _Trailed(grpc.StatusCode.FAILED_PRECONDITION, ((MODEL_MISMATCH_KEY, "1"),))
    tries = Attempts(FailoverPolicy(max_retries=9), 2, 0, None)
    assert (tries.after(UNAVAILABLE), tries.router) == (0.0, 1)
    assert (tries.after(foreign), tries.router) == (0.5, 0)
    # 1 is skipped: 0 again, which just failed, after a longer pause (it was tried at once).
    assert (tries.after(UNAVAILABLE), tries.router) == (1.0, 0)
    assert tries.after(foreign) is None
    # FAILED_PRECONDITION without the mark (a chat the template refuses) is the caller's.
    assert Attempts(FailoverPolicy(), 2, 0, None).after(
        _Failed(grpc.StatusCode.FAILED_PRECONDITION)) is None
    assert Attempts(FailoverPolicy(), 1, 0, None).after(foreign) is None


def test_a_continuation_expects_the_model_its_stream_began_with():
    tries = Attempts(FailoverPolicy(), 2, 0, None)
    ident = router_pb2.ModelIdentity(name="m", fingerprint="f:w", chat_template="t")
    first = take_chunk(router_pb2.GenerateChunk(token_ids=[5], model=ident), [], tries)
    assert first.model is not None and first.model.fingerprint == "f:w"
    other = router_pb2.ModelIdentity(name="m2", fingerprint="f:w", chat_template="t")
    # The caller sees the model once, even where a continuation's first chunk names its own.
    assert take_chunk(router_pb2.GenerateChunk(token_ids=[6], model=other), [], tries).model \
        is None
    req = router_pb2.GenerateRequest(request_id="r")
    assert not attempt_request(req, [5], 0, tries.model).HasField("expect_model")
    assert attempt_request(req, [5], 1, tries.model).expect_model == ident
    assert not attempt_request(req, [], 1, None).HasField("expect_model")
    mine = router_pb2.GenerateRequest(expect_model=other)  # the caller's own stays
    assert attempt_request(mine, [5], 1, tries.model).expect_model == other


def test_a_pin_must_be_a_model_identity():
    from client import ModelIdentity
    from client.types import build_request

    ident = ModelIdentity("m", "f:w", "t")
    assert build_request("hi", None, {}, ident).expect_model == router_pb2.ModelIdentity(
        name="m", fingerprint="f:w", chat_template="t")
    assert not build_request("hi", None, {}).HasField("expect_model")
    with pytest.raises(TypeError, match="expect_model must be a ModelIdentity"):
        build_request("hi", None, {}, "f:w")


class _EndsThenFails(router_pb2_grpc.RouterServicer):
    """A router that streams every final chunk, then is lost before the closing status."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def Generate(self, request, context):
        self.calls += 1
        for i in range(self.n):
            yield router_pb2.GenerateChunk(token_ids=[10 + i], index=i)
        for i in range(self.n):
            yield router_pb2.GenerateChunk(token_ids=[20 + i], index=i, finish_reason="stop",
                                           usage=router_pb2.Usage(completion_tokens=2))
        context.abort(grpc.StatusCode.UNAVAILABLE, "router lost before its trailers")


def _serve(routers: list) -> tuple[list, list[str]]:
    """Each fake router on a server of its own: (the servers, their addresses)."""
    from concurrent.futures import ThreadPoolExecutor

    servers, addresses = [], []
    for router in routers:
        servers.append(grpc.server(ThreadPoolExecutor(4)))
        router_pb2_grpc.add_RouterServicer_to_server(router, servers[-1])
        addresses.append(f"127.0.0.1:{servers[-1].add_insecure_port('127.0.0.1:0')}")
        servers[-1].start()
    return servers, addresses


@pytest.mark.parametrize("n", [1, 3])
def test_a_stream_whose_final_chunks_arrived_is_not_resumed_elsewhere(n):
    from client import Client

    routers = [_EndsThenFails(n) for _ in range(2)]
    servers, addresses = _serve(routers)
    policy = FailoverPolicy(health_check_interval_s=0, backoff_s=0.0)
    want = sorted([10 + i for i in range(n)] + [20 + i for i in range(n)])
    try:
        with Client(addresses, timeout=30, failover=policy) as c:
            got = [t for ch in c.generate([5, 6], max_tokens=2, n=n) for t in ch.token_ids]
        assert sorted(got) == want

        async def stream():
            async with AsyncClient(addresses, timeout=30, failover=policy) as ac:
                return [t async for ch in ac.generate([5, 6], max_tokens=2, n=n)
                        for t in ch.token_ids]

        assert sorted(asyncio.run(stream())) == want
        # Each client's stream ran once: no continuation, no second answer.
        assert sum(r.calls for r in routers) == 2
    finally:
        for server in servers:
            server.stop(None)


class _CutShort(router_pb2_grpc.RouterServicer):
    """A router whose streams close OK after their first token, with no final chunk (a fault
    behind it); with ``short=False``, one that goes on from the resumed tokens to the end."""

    def __init__(self, short: bool) -> None:
        self.short, self.resumed = short, []

    def Generate(self, request, context):
        self.resumed.append(list(request.resume_token_ids))
        if self.short:
            yield router_pb2.GenerateChunk(request_id="r", token_ids=[7])
            return
        yield router_pb2.GenerateChunk(request_id="r", token_ids=[8, 9], finish_reason="length",
                                       usage=router_pb2.Usage(completion_tokens=3))


def test_a_stream_closed_without_its_finish_reason_fails_over_or_raises():
    """A stream closed OK before its final chunk was cut short, not finished: it goes on on the
    next router from the tokens it has, and with no other try left it raises, for both clients
    (it ended quietly, as if done, with part of the output)."""
    from client import Client, UnavailableError

    routers = [_CutShort(True), _CutShort(False)]
    servers, addresses = _serve(routers)
    policy = FailoverPolicy(health_check_interval_s=0, backoff_s=0.0)
    alone = FailoverPolicy(health_check_interval_s=0, max_retries=0)

    async def stream(addresses, policy):
        async with AsyncClient(addresses, timeout=30, failover=policy) as ac:
            return [ch async for ch in ac.generate([5, 6], max_tokens=3)]

    try:
        with Client(addresses, timeout=30, failover=policy) as c:
            blocking = list(c.generate([5, 6], max_tokens=3))
        for chunks in (blocking, asyncio.run(stream(addresses, policy))):
            assert [t for ch in chunks for t in ch.token_ids] == [7, 8, 9]
            assert chunks[-1].finish_reason == "length" and chunks[-1].usage.migrations == 1
        assert routers[1].resumed == [[7], [7]]
        with Client(addresses, timeout=30, failover=alone) as c:
            with pytest.raises(UnavailableError, match="without a finish reason"):
                list(c.generate([5, 6], max_tokens=3))
        with pytest.raises(UnavailableError, match="without a finish reason"):
            asyncio.run(stream(addresses, alone))
    finally:
        for server in servers:
            server.stop(None)


def test_attempts_know_when_every_sequence_has_ended():
    tries = Attempts(FailoverPolicy(), 1, 0, None)
    req = router_pb2.GenerateRequest(sampling=common_pb2.SamplingParams(n=2))
    tries.track(req)
    assert not tries.resumable and not tries.complete
    for index, reason in ((0, ""), (0, "stop"), (1, "")):
        take_chunk(router_pb2.GenerateChunk(index=index, finish_reason=reason), [], tries)
    assert not tries.complete
    take_chunk(router_pb2.GenerateChunk(index=1, finish_reason="length"), [], tries)
    assert tries.complete


def test_a_one_token_prompts_logprobs_are_none_alone_on_sequence_0s_first_chunk():
    """The wire carries prompt tokens 1.. (none for a one-token prompt); the caller gets
    [None], as from the engine in process, on sequence 0's first chunk only: not on another
    sequence's, nor on a continuation's (the router leaves them out of one)."""
    tries = Attempts(FailoverPolicy(), 1, 0, None)
    tries.track(router_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(n=2, prompt_logprobs=1)))
    chunks = [take_chunk(router_pb2.GenerateChunk(index=i, token_ids=[5]), [], tries)
              for i in (1, 0, 0)]
    assert [ch.prompt_logprobs for ch in chunks] == [None, [None], None]
    unasked = Attempts(FailoverPolicy(), 1, 0, None)
    unasked.track(router_pb2.GenerateRequest())
    assert take_chunk(router_pb2.GenerateChunk(token_ids=[5]), [], unasked).prompt_logprobs \
        is None


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), 1e10, True, "5"])
def test_bad_timeouts_are_refused_before_any_call(timeout):
    from client import Client

    with pytest.raises(ValueError, match="timeout"):
        Client("127.0.0.1:1", timeout=timeout)
    with pytest.raises(ValueError, match="timeout"):
        AsyncClient("127.0.0.1:1", timeout=timeout)
    with Client("127.0.0.1:1", failover=FailoverPolicy(health_check_interval_s=0)) as c:
        with pytest.raises(ValueError, match="timeout"):
            c.model_info(timeout=timeout)
        # Nothing listens there: a NaN, inf or 1e10 s wait_ready waited for good.
        with pytest.raises(ValueError, match="timeout"):
            c.wait_ready(timeout)

    async def wait_ready():
        async with AsyncClient("127.0.0.1:1",
                               failover=FailoverPolicy(health_check_interval_s=0)) as ac:
            await ac.wait_ready(timeout)

    with pytest.raises(ValueError, match="timeout"):
        asyncio.run(wait_ready())


@pytest.mark.parametrize("bad", [[], [""], 5, "127.0.0.1:70000", ["h:1", "[::1]:65536"],
                                 "dns:///h:0"])
def test_bad_addresses_and_policies_are_refused(bad):
    with pytest.raises(ValueError):
        check_addresses(bad)
    with pytest.raises(ValueError):
        FailoverPolicy(max_retries=-1)


@pytest.fixture(scope="module")
def cluster():
    spec = ClusterSpec(model=MODEL, num_decode=1, worker_args=WORKER_ARGS,
                       router_args=["--max-local-prefill-length", "0"])
    with Cluster(spec) as c:
        yield c


def _generate_raw(cluster, prompt, resume, max_tokens, expect=None):
    req = router_pb2.GenerateRequest(
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                           ignore_eos=True), resume_token_ids=resume,
        expect_model=expect)
    req.token_ids.ids.extend(prompt)
    with grpc.insecure_channel(cluster.router_address) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Generate(req, timeout=60))


def test_a_router_continues_from_resume_tokens(cluster, reference):
    (prompt,), (want,) = decisive_outputs(reference, 1, seed=71, max_tokens=10, lo=30, hi=30)
    ours = _identity(cluster.router_address)
    chunks = _generate_raw(cluster, prompt, want.token_ids[:4], 10, ours)
    assert [t for c in chunks for t in c.token_ids] == want.token_ids[4:]
    assert chunks[-1].usage.completion_tokens == 10  # the resumed ones count
    assert chunks[0].model == ours and not chunks[1].HasField("model")
    files, _, weights = ours.fingerprint.partition(":")
    assert len(files) == len(weights) == 16
    # Another model's stream (weights of its own) is not this router's to go on with.
    other = router_pb2.ModelIdentity(name=ours.name, fingerprint=f"{files}:{'0' * 16}")
    with pytest.raises(grpc.RpcError) as err:
        _generate_raw(cluster, prompt, want.token_ids[:4], 10, other)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "weights differ" in err.value.details()
    assert (MODEL_MISMATCH_KEY, "1") in tuple(err.value.trailing_metadata())
    for resume, match in [([10**8], "outside the vocabulary"), ([5] * 10, "nothing to generate")]:
        with pytest.raises(grpc.RpcError) as err:
            _generate_raw(cluster, prompt, resume, 10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in err.value.details()


def test_streams_survive_their_router_killed_under_them(cluster, reference):
    first = next(p for p in cluster.procs if p.role == "router")
    second = cluster.start_router()
    addresses = [first.address, second.address]
    # Long enough that no stream on the router to be killed ends before the kill: at 40
    # tokens, on a loaded machine, one ended while the last was still waiting for its fourth.
    # Decisive: a continuation's logits are computed in another batch than the reference's.
    prompts, want = decisive_outputs(reference, 6, seed=72, max_tokens=160, lo=20, hi=60)
    params = dict(max_tokens=160, **GREEDY)

    async def stream(client, prompt, got):
        final, text = None, []
        async for chunk in client.generate(prompt, **params):
            got.extend(chunk.token_ids)
            text.append(chunk.text)
            final = chunk
        return final, "".join(text)

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient(addresses, timeout=120) as client:
            tasks = [asyncio.ensure_future(stream(client, p, g)) for p, g in zip(prompts, got)]
            while not all(len(g) >= 4 for g in got):
                await asyncio.sleep(0.005)
            first.popen.kill()  # half the streams came through it (round robin)
            results = await asyncio.gather(*tasks)
            after = await client.complete(prompts[0], **params)  # the dead one is skipped
        return got, results, after

    got, results, after = asyncio.run(run())
    assert got == [w.token_ids for w in want]
    assert [text for _, text in results] == [w.text for w in want]
    moved = [final for final, _ in results if final.usage.migrations]
    assert len(moved) == 3
    assert all(f.usage.completion_tokens == 160 for f, _ in results)
    assert after.token_ids == want[0].token_ids
    wait_all_blocks_free([p.address for p in cluster.procs if p.role != "router"])


def test_streams_survive_their_router_hanging_under_them(cluster, reference):
    """A router that stops answering but keeps its connections open (SIGSTOP) is found by the
    client's health checks (client/liveness.py); its streams go on on the other router."""
    hung = cluster.start_router()
    live = cluster.start_router()  # last: cluster.router_address, for the tests after
    prompts, want = decisive_outputs(reference, 4, seed=74, max_tokens=160, lo=20, hi=60)
    # Long enough that none ends before the stop: at 40 tokens, a stream on the router to be
    # stopped ended (336 ms) while the last one still waited for its fourth token, on a loaded
    # CI machine, and only one stream was left there to move.
    params = dict(max_tokens=160, **GREEDY)
    policy = FailoverPolicy(health_check_interval_s=1.0)

    async def run():
        got = [[] for _ in prompts]
        async with AsyncClient([hung.address, live.address], timeout=300,
                               failover=policy) as client:
            async def stream(prompt, g):
                final = None
                async for chunk in client.generate(prompt, **params):
                    g.extend(chunk.token_ids)
                    final = chunk
                return final

            tasks = [asyncio.ensure_future(stream(p, g)) for p, g in zip(prompts, got)]
            while not all(len(g) >= 4 for g in got):
                await asyncio.sleep(0.005)
            os.kill(hung.popen.pid, signal.SIGSTOP)
            try:
                return got, await asyncio.gather(*tasks)
            finally:
                os.kill(hung.popen.pid, signal.SIGCONT)

    got, finals = asyncio.run(run())
    assert got == [w.token_ids for w in want]
    assert sum(bool(f.usage.migrations) for f in finals) == 2  # round robin: half were on it
    # Resumed, the router finds its clients gone and cancels their requests on the workers.
    wait_all_blocks_free([p.address for p in cluster.procs if p.role != "router"])
    assert cluster.stop_proc(hung) == 0


def test_keepalive_settings_are_checked_and_reach_the_channel_options():
    assert FailoverPolicy(keepalive_time_s=None).channel_options() == []
    opts = dict(FailoverPolicy(keepalive_time_s=2.5, keepalive_timeout_s=0.5).channel_options())
    assert opts["grpc.keepalive_time_ms"] == 2500 and opts["grpc.keepalive_timeout_ms"] == 500
    for bad in (dict(keepalive_time_s=0), dict(keepalive_timeout_s=-1.0),
                dict(keepalive_timeout_s=None), dict(keepalive_time_s=True)):
        with pytest.raises(ValueError, match="keepalive"):
            FailoverPolicy(**bad)


def test_the_blocking_client_skips_a_router_that_is_down(cluster, reference):
    from client import Client
    from router.redis_server import free_port

    (prompt,), (want,) = decisive_outputs(reference, 1, seed=73, max_tokens=6, lo=20, hi=20)
    down = f"127.0.0.1:{free_port()}"  # nothing listens there
    with Client([down, cluster.router_address], timeout=60) as c:
        chunks = list(c.generate(prompt, max_tokens=6, **GREEDY))  # tried on `down` first
        assert [t for ch in chunks for t in ch.token_ids] == want.token_ids
        assert chunks[-1].usage.migrations == 1
        done = c.complete(prompt, max_tokens=6, **GREEDY)  # the next in turn: the live one
        assert done.token_ids == want.token_ids and done.usage.migrations == 0


# Two chat templates: the routers that render with one give a chat another prompt than those
# that render with the other, as two models would.
_TEMPLATE_A = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
_TEMPLATE_B = "{% for m in messages %}{{ m.role | upper }}: {{ m.content }}\n{% endfor %}A:"


def _chat_ids(address: str, chat: list[dict]) -> list[int]:
    req = router_pb2.TokenizeRequest()
    for m in chat:
        req.chat.messages.add(role=m["role"], content=m["content"])
    with grpc.insecure_channel(address) as ch:
        return list(router_pb2_grpc.RouterStub(ch).Tokenize(req, timeout=30).token_ids)


def _identity(address: str) -> router_pb2.ModelIdentity:
    with grpc.insecure_channel(address) as ch:
        return router_pb2_grpc.RouterStub(ch).GetModelInfo(router_pb2.ModelInfoRequest(),
                                                           timeout=30).identity


def _decisive_chats(reference, routers: dict[str, str], n: int, params: dict):
    """``n`` chats whose greedy outputs are decisive (tests/serving_helpers.py) as each router
    renders them, and those outputs' token ids by router name."""
    words = ["rivers", "stars", "bread", "trains", "ice", "gold", "salt", "wind", "clay",
             "moss", "tin", "rain", "fern", "silk", "coal", "reef", "owls", "sand", "wool",
             "kelp", "lava", "dust", "pine", "glass"]
    chats = [[{"role": "user", "content": f"tell me about {w} and {i}"}]
             for i, w in enumerate(words)]
    # The first n decisive ones, in order: generated a few at a time, so the chats past them
    # are not generated at all (each is, once per router, 160 tokens).
    outs: dict[str, list] = {name: [] for name in routers}
    keep: list[int] = []
    for start in range(0, len(chats), n + 3):
        if len(keep) >= n:
            break
        part = chats[start:start + n + 3]
        for name, address in routers.items():
            outs[name] += reference.generate([_chat_ids(address, chat) for chat in part],
                                             SamplingParams(**params, logprobs=2))
        keep += [i for i in range(start, start + len(part))
                 if all(greedy_is_decisive(o[i], params["max_tokens"]) for o in outs.values())]
    assert len(keep) >= n, f"{len(keep)} decisive chats of {len(chats)}"
    keep = keep[:n]
    return ([chats[i] for i in keep],
            {name: [o[i].token_ids for i in keep] for name, o in outs.items()})


# The slow tier (8 s): the SDK's side (a router of another model skipped, a stream ended once
# every router refused) is unit-tested above, and a router's refusal of an expect_model
# through a real cluster is tests/test_chat_serving.py's.
@pytest.mark.slow
def test_a_stream_goes_on_only_on_a_router_of_its_model(cluster, reference):
    """Routers a and c render chats with one template, b with another. The streams a began
    go on on c when a dies, past b, where the continuation of another prompt would read as
    fluent text and be wrong; a (blocking) client that knows only a and b gives up once a
    stays down, saying b serves another model."""
    from client import Client, FailedPreconditionError, ModelIdentity, UnavailableError

    a = cluster.start_router(extra=["--chat-template", _TEMPLATE_A])
    b = cluster.start_router(extra=["--chat-template", _TEMPLATE_B])
    c = cluster.start_router(extra=["--chat-template", _TEMPLATE_A])  # cluster.router_address
    ident = {p.address: _identity(p.address) for p in (a, b, c)}
    assert ident[a.address] == ident[c.address] != ident[b.address]
    assert ident[a.address].fingerprint == ident[b.address].fingerprint  # one model
    params = dict(max_tokens=160, **GREEDY)
    chats, want = _decisive_chats(reference, {"a": a.address, "b": b.address}, 3, params)
    assert want["a"][0] != want["b"][0]  # b going on with a's stream would be seen
    # Round robin: the client's stream i begins on router i (c renders as a does).
    began = ["a", "b", "a"]

    lone_got: list[int] = []

    def lone_stream():  # the blocking client, on its own thread
        with Client([a.address, b.address], timeout=300) as lone:
            for chunk in lone.generate(chats[0], **params):
                lone_got.extend(chunk.token_ids)

    async def run():
        got = [[] for _ in chats]
        async with AsyncClient([a.address, b.address, c.address], timeout=300) as client:
            async def stream(chat, g):
                first = final = None
                async for chunk in client.generate(chat, **params):
                    g.extend(chunk.token_ids)
                    first = first or chunk
                    final = chunk
                return first, final

            tasks = [asyncio.ensure_future(stream(ch, g)) for ch, g in zip(chats, got)]
            stranded = asyncio.ensure_future(asyncio.to_thread(lone_stream))
            while not all(len(g) >= 4 for g in [*got, lone_got]):
                await asyncio.sleep(0.005)
            a.popen.kill()
            with pytest.raises(UnavailableError, match="1 of the client's 2 routers serve "
                               "another model than the one this stream began with"):
                await stranded
            return got, await asyncio.gather(*tasks)

    got, ends = asyncio.run(run())
    assert got == [want[t][i] for i, t in enumerate(began)]
    assert lone_got == want["a"][0][:len(lone_got)]  # b did not go on with it
    for i, (first, final) in enumerate(ends):
        router = [a, b, c][i % 3]
        assert first.model.chat_template == ident[router.address].chat_template
        # a's went on on c past b's refusal: two attempts after the first, one of them a move.
        assert final.usage.migrations == (1 if i % 3 == 0 else 0)
    with Client(c.address, timeout=60) as one:
        done = one.complete(chats[0], max_tokens=2)
        info = one.model_info()
    assert done.model == info.identity == ModelIdentity(**{
        f.name: v for f, v in ident[c.address].ListFields()})
    # A caller's pin: only a router of the model answers, whichever the client tries first.
    with Client([b.address, c.address], timeout=60) as two:
        pinned = two.complete(chats[0], max_tokens=2, expect_model=info.identity)  # b first
        # b's refusal of the pin moved nothing.
        assert pinned.model == info.identity and pinned.usage.migrations == 0
    with Client(b.address, timeout=60) as only_b:
        with pytest.raises(FailedPreconditionError, match="chat templates differ"):
            only_b.complete(chats[0], max_tokens=2, expect_model=info.identity)
        # A text prompt does not go through the template: b serves it.
        assert only_b.complete("hello", max_tokens=2, expect_model=info.identity).model \
            == ModelIdentity(**{f.name: v for f, v in ident[b.address].ListFields()})
    # pdserve chat through [b, c]: model_info came from b, so every turn is b's to answer (c,
    # tried first for the turn, would render another prompt).
    hello = [{"role": "user", "content": "Hello"}]
    replies = {name: reference.generate([_chat_ids(p.address, hello)], SamplingParams(
        max_tokens=8, temperature=0.0, logprobs=2))[0] for name, p in (("b", b), ("c", c))}
    assert greedy_is_decisive(replies["b"], 8) and replies["b"].text != replies["c"].text
    proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "chat", "--router", f"{b.address},{c.address}",
         "--max-tokens", "8"], input="Hello\n/exit\n", capture_output=True, text=True,
        timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"{replies['b'].text}\n"
    # pdserve info finds what this client could not have seen until a failover: b and c differ.
    info_proc = subprocess.run(
        [sys.executable, "-m", "engine.cli", "info", "--router", f"{b.address},{c.address}"],
        capture_output=True, text=True, timeout=60)
    assert info_proc.returncode == 1 and "serve different models" in info_proc.stderr
    assert f"chat template {ident[b.address].chat_template}" in info_proc.stdout
    wait_all_blocks_free([p.address for p in cluster.procs if p.role != "router"])
    assert cluster.stop_proc(b) == 0
