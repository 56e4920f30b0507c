"""Parallel sampling's fan-out (router/parallel.py) on fake sequence streams: tagging, the
staggered start, a failing sequence failing the request, and every sequence closed."""
from __future__ import annotations

import asyncio
import contextlib

import pytest

from protos import common_pb2, router_pb2
from router.parallel import check_n, fan_out, request_usage, sequence_request


def _run(coro):
    return asyncio.run(coro)


class _Streams:
    def __init__(self, n: int, tokens: int, fail: int | None = None) -> None:
        self.n, self.tokens, self.fail = n, tokens, fail
        self.started: list[tuple[int, int]] = []  # (sequence, chunks of 0 seen by then)
        self.closed: set[int] = set()
        self.seen0 = 0

    def factory(self, i: int):
        async def stream():
            self.started.append((i, self.seen0))
            try:
                for t in range(self.tokens):
                    await asyncio.sleep(0)
                    if i == self.fail and t == 1:
                        raise ValueError(f"sequence {i} failed")
                    if i == 0:
                        self.seen0 += 1
                    yield router_pb2.GenerateChunk(request_id=f"r/{i}", token_ids=[100 * i + t])
                    await asyncio.sleep(0.001)
            finally:
                self.closed.add(i)
        return stream


def _collect(streams: _Streams, limit: int | None = None):
    async def go():
        out = []
        agen = fan_out("r", [streams.factory(i) for i in range(streams.n)])
        try:
            async for c in agen:
                out.append(c)
                if limit is not None and len(out) == limit:
                    break
        finally:
            await agen.aclose()
        return out
    return _run(go())


def test_chunks_are_tagged_and_each_sequence_keeps_its_order():
    s = _Streams(3, 4)
    out = _collect(s)
    assert {c.request_id for c in out} == {"r"}
    for i in range(3):
        assert [c.token_ids[0] for c in out if c.index == i] == [100 * i + t for t in range(4)]
    # The others start once sequence 0 has produced its first chunk.
    assert s.started[0] == (0, 0) and all(seen >= 1 for i, seen in s.started[1:])
    assert s.closed == {0, 1, 2}


def test_a_failing_sequence_fails_the_request_and_closes_the_others():
    s = _Streams(3, 50, fail=2)
    with pytest.raises(ValueError, match="sequence 2 failed"):
        _collect(s)
    assert s.closed == {0, 1, 2}


def test_leaving_early_closes_every_sequence():
    s = _Streams(4, 1000)
    assert len(_collect(s, limit=6)) == 6
    assert s.closed == {0, 1, 2, 3}


def test_a_sequence_cancelled_by_nobody_fails_the_request_and_hangs_nothing():
    """A sequence's stream raising a CancelledError its pump was not sent (a call something
    else cancelled) put no end on the queue: the request waited until its deadline."""
    closed = []

    def factory(i: int):
        async def stream():
            try:
                yield router_pb2.GenerateChunk(token_ids=[i])
                if i == 1:
                    lost = asyncio.get_running_loop().create_future()
                    asyncio.get_running_loop().call_soon(lost.cancel)
                    await lost
                await asyncio.sleep(3600)
            finally:
                closed.append(i)
        return stream

    async def go():
        out = []
        async with contextlib.aclosing(fan_out("r", [factory(i) for i in range(3)])) as agen:
            async with asyncio.timeout(30):
                async for c in agen:
                    out.append(c.index)
        return out

    with pytest.raises(asyncio.CancelledError):
        _run(go())
    assert sorted(closed) == [0, 1, 2]


def test_check_n_and_sequence_seeds():
    assert check_n(common_pb2.SamplingParams(), False) == 1
    assert check_n(common_pb2.SamplingParams(n=8), False) == 8
    for bad in (0, -1, 65):
        with pytest.raises(ValueError, match="n must be in"):
            check_n(common_pb2.SamplingParams(n=bad), False)
    with pytest.raises(ValueError, match="cannot be used with n > 1"):
        check_n(common_pb2.SamplingParams(n=2), True)
    req = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(n=3, seed=5))
    seqs = [sequence_request(req, i) for i in range(3)]
    assert [q.sampling.seed for q in seqs] == [5, 6, 7]
    top = router_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
        n=3, seed=2**63 - 2))  # any int64 is a valid seed, with n > 1 too
    assert [sequence_request(top, i).sampling.seed for i in range(3)] == [2**63 - 2, 2**63 - 1,
                                                                          -2**63]
    assert not any(q.sampling.HasField("n") for q in seqs) and req.sampling.n == 3
    unseeded = sequence_request(router_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(n=3)), 2)
    assert not unseeded.sampling.HasField("seed")


def test_a_requests_usage_counts_its_prompt_once_and_sums_its_choices_output():
    usages = []
    for i, (tokens, e2e) in enumerate([(6, 0.5), (4, 0.9), (5, 0.7)]):
        u = router_pb2.Usage(prompt_tokens=70, completion_tokens=tokens,
                             cached_tokens=0 if i == 0 else 64, decode_worker_id=f"d{i}",
                             migrations=1 if i == 2 else 0)
        u.timings.ttft_s, u.timings.e2e_s = 0.1 * (i + 1), e2e
        usages.append(u)
    total = request_usage(usages)
    assert (total.prompt_tokens, total.completion_tokens, total.cached_tokens) == (70, 15, 0)
    assert (total.timings.ttft_s, total.timings.e2e_s) == (0.1, 0.9)
    assert total.decode_worker_id == "d0" and total.migrations == 1
    assert usages[0].completion_tokens == 6  # the choices keep their own
