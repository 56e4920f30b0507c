"""RouterAdmin.CancelRequest ends a request with a status its client reads: also when the
cancel of its handler's task is lost (Python 3.11's asyncio.wait_for inside redis-py swallows
one landing as a Redis reply arrives: client/tasks.py), and when it comes while gRPC writes a
chunk (grpc.aio takes a task cancel there for the client's and sends no status). The router's
request path in process, its workers replaced by a stream of chunks, gRPC's writes by sleeps."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import pytest

import router.inflight

from protos import common_pb2, router_pb2, worker_pb2
from router.config import RouterConfig
from router.directory import WorkerHandle
from router.errors import RouterRejectError
from router.migration import RequestRun
from router.prompts import load_served_model
from router.service import RouterServicer
from router.stats import RouterStats


class _Directory:
    @contextlib.contextmanager
    def inflight(self, worker):
        yield

    @contextlib.contextmanager
    def in_use(self, worker):
        yield

    def check_prompt_fits(self, num_tokens: int, requested_len: int = 0) -> None:
        """As WorkerDirectory's while no worker is known: any length passes."""


def _servicer(stall_after: int | None = None) -> RouterServicer:
    model = load_served_model("tiny-llama", "auto", None)
    servicer = RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused"),
                              _Directory(), model, RouterStats(8))

    async def sequence(run, request, context):  # what the workers would stream
        for i in range(100):
            if i == stall_after:
                await asyncio.Event().wait()  # a decode step that never comes
            await asyncio.sleep(0.005)
            yield router_pb2.GenerateChunk(request_id=run.request_id, token_ids=[100 + i])

    servicer._sequence = sequence
    return servicer


REQUEST = router_pb2.GenerateRequest(
    request_id="r1", token_ids=router_pb2.TokenIds(ids=[11, 12, 13]),
    sampling=common_pb2.SamplingParams(max_tokens=100, temperature=0.0))


def _operator_cancelled(body) -> None:
    with pytest.raises(RouterRejectError) as err:
        asyncio.run(body())
    assert err.value.code == grpc.StatusCode.CANCELLED
    assert "operator" in str(err.value)


def test_an_operator_cancel_whose_task_cancel_was_lost_still_ends_the_request():
    servicer = _servicer()
    got = []

    async def body():
        async for chunk in servicer._generate(REQUEST, None, time.monotonic()):
            got.append(chunk)
            if len(got) == 3:
                # What CancelRequest does, but with the task's cancel lost.
                servicer.inflight._by_id["r1"].cancelled = True

    _operator_cancelled(body)
    assert len(got) == 3 and len(servicer.inflight) == 0


def test_an_operator_cancel_during_a_write_waits_for_it_and_ends_the_request():
    servicer = _servicer()
    got = []

    async def body():  # as grpc.aio serves a stream: a write after each chunk
        async for chunk in servicer._generate(REQUEST, None, time.monotonic()):
            got.append(chunk)
            if len(got) == 3:
                asyncio.get_running_loop().call_soon(servicer.inflight.cancel, "r1")
            await asyncio.sleep(0.05)  # the write: a task cancel here would end it unseen

    _operator_cancelled(body)
    assert len(got) == 3 and len(servicer.inflight) == 0


def test_an_operator_cancel_while_waiting_for_a_token_cuts_the_wait():
    servicer = _servicer(stall_after=3)

    async def body():
        async with asyncio.timeout(20):  # the stall is forever: only the cancel ends it
            async for chunk in servicer._generate(REQUEST, None, time.monotonic()):
                if chunk.token_ids[0] == 102:
                    asyncio.get_running_loop().call_later(0.05, servicer.inflight.cancel, "r1")

    _operator_cancelled(body)
    assert len(servicer.inflight) == 0


def test_a_write_that_never_returns_is_cut_after_the_grace_period(monkeypatch):
    monkeypatch.setattr(router.inflight, "WRITE_GRACE_S", 0.05)
    servicer = _servicer()

    async def body():
        async for chunk in servicer._generate(REQUEST, None, time.monotonic()):
            asyncio.get_running_loop().call_soon(servicer.inflight.cancel, "r1")
            await asyncio.sleep(30)  # a client that stopped reading: the write never returns

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(body())
    assert len(servicer.inflight) == 0


class _PrefillStub:
    """A prefill worker whose Prefill answers with ``outcome`` (an exception), or never
    (its answer on the wire when the router's wait is cut); ReleaseKV calls are recorded."""

    def __init__(self, outcome: BaseException | None = None) -> None:
        self.outcome = outcome
        self.released: list[str] = []
        self.called = False

    async def Prefill(self, request, timeout):
        self.called = True
        if self.outcome is not None:
            raise self.outcome
        await asyncio.Event().wait()

    async def ReleaseKV(self, request, timeout):
        self.released.append(request.request_id)
        return worker_pb2.ReleaseKVResponse(released=True)


class _Context:
    def __init__(self, remaining_s: float = 30.0) -> None:
        self.remaining_s = remaining_s

    def time_remaining(self) -> float:
        return self.remaining_s


def _prefill_released(stub: _PrefillStub, cut_after_s: float | None,
                      context: _Context | None = None) -> list[str]:
    """The ids ReleaseKV was called with: "attempt" for the attempt's own."""
    servicer = _servicer()
    prefill = WorkerHandle(common_pb2.WorkerInfo(worker_id="prefill-x", role="prefill"),
                           None, stub, None)
    run = RequestRun("r9", [11, 12, 13], time.monotonic())

    counts_ended = []

    async def body():
        # ``counted``: the end of the prefill worker's in-flight count, which the pick took.
        chunks = servicer._remote_prefill(run, REQUEST, prefill, frozenset(),
                                          context or _Context(),
                                          lambda: counts_ended.append(1))
        first = asyncio.ensure_future(anext(chunks))
        if cut_after_s is not None:
            await asyncio.sleep(cut_after_s)
            first.cancel()  # the client's cancel or deadline
        with contextlib.suppress(BaseException):
            await first
        await asyncio.gather(*servicer._release_tasks)

    asyncio.run(body())
    assert counts_ended == [1]  # the Prefill call ended, however: its count with it
    return ["attempt" if rid == run.attempt_id else rid for rid in stub.released]


def test_a_request_cut_while_its_prefill_answers_releases_the_lease():
    """Cut while waiting for Prefill's answer: the worker may have leased the KV already (its
    answer on the wire), so the router releases it instead of leaving it to expire."""
    assert _prefill_released(_PrefillStub(), cut_after_s=0.05) == ["attempt"]


@pytest.mark.parametrize("code, released", [
    (grpc.StatusCode.RESOURCE_EXHAUSTED, []),  # refused: nothing was leased
    (grpc.StatusCode.INVALID_ARGUMENT, []),
    (grpc.StatusCode.DEADLINE_EXCEEDED, ["attempt"]),  # unknown: it may have been
    (grpc.StatusCode.UNAVAILABLE, ["attempt"]),
])
def test_a_failed_prefill_is_released_unless_the_worker_refused_it(code, released):
    error = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), "x")
    assert _prefill_released(_PrefillStub(error), cut_after_s=None) == released


def test_a_prefill_never_sent_for_lack_of_time_is_not_released():
    """A request whose deadline passed before its Prefill call ends DEADLINE_EXCEEDED with no
    ReleaseKV: one for an id the worker never saw only takes a place in its stray records."""
    stub = _PrefillStub()
    assert _prefill_released(stub, cut_after_s=None, context=_Context(-0.01)) == []
    assert not stub.called
