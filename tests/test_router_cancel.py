"""RouterAdmin.CancelRequest ends a request with a status its client reads: also when the
cancel of its handler's task is lost (Python 3.11's asyncio.wait_for inside redis-py swallows
one landing as a Redis reply arrives: client/tasks.py), and when it comes while gRPC writes a
chunk (grpc.aio takes a task cancel there for the client's and sends no status). The router's
request path in process, its workers replaced by a stream of chunks, gRPC's writes by sleeps,
or served on loopback to a client that stops reading."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import grpc
import pytest

import router.inflight

from engine.grpc_server import GrpcServer, ServerConfig
from protos import common_pb2, router_pb2, router_pb2_grpc, worker_pb2
from router.admin import RouterAdminServicer
from router.config import RouterConfig
from router.directory import WorkerHandle
from router.errors import RouterRejectError
from router.migration import RequestRun
from router.prompts import load_served_model
from router.service import RouterServicer
from router.stats import RouterStats
from router.write_watch import WriteWatch


class _Directory:
    @contextlib.contextmanager
    def inflight(self, worker):
        yield

    @contextlib.contextmanager
    def in_use(self, worker):
        yield

    def check_prompt_fits(self, num_tokens: int, requested_len: int = 0) -> None:
        """As WorkerDirectory's while no worker is known: any length passes."""


def _servicer(stall_after: int | None = None, chunks: int = 100, tokens_per_chunk: int = 1,
              **config) -> RouterServicer:
    model = load_served_model("tiny-llama", "auto", None)
    servicer = RouterServicer(RouterConfig(model="tiny-llama", redis_url="redis://unused",
                                           **config), _Directory(), model, RouterStats(8))

    async def sequence(run, request, context):  # what the workers would stream
        for i in range(chunks):
            if i == stall_after:
                await asyncio.Event().wait()  # a decode step that never comes
            await asyncio.sleep(0.005)
            yield router_pb2.GenerateChunk(request_id=run.request_id,
                                           token_ids=[100 + i] * tokens_per_chunk)

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


class _StuckContext:
    async def write(self, message) -> None:
        await asyncio.Event().wait()  # a client that stopped reading: the write never returns


def test_a_write_that_never_returns_is_given_up_after_the_grace_period(monkeypatch):
    monkeypatch.setattr(router.inflight, "WRITE_GRACE_S", 0.05)
    servicer = _servicer()

    async def body():  # as Generate writes the chunks
        writes = WriteWatch(0)
        chunks = servicer._generate(REQUEST, None, time.monotonic(), writes=writes)
        async with contextlib.aclosing(chunks):
            async for chunk in chunks:
                asyncio.get_running_loop().call_soon(servicer.inflight.cancel, "r1")
                await writes.write(_StuckContext(), chunk)

    _operator_cancelled(body)
    assert len(servicer.inflight) == 0


def _stalled_reader_servicer() -> RouterServicer:
    """Chunks of 2 KB for as long as the request lasts; no --client-write-timeout-s, so that
    only the operator's cancel can end a write stuck on a client that stopped reading."""
    return _servicer(chunks=10**6, tokens_per_chunk=1000, client_write_timeout_s=0)


async def _serve(servicer: RouterServicer, body):
    """``body(channel, admin)`` against the servicer and its RouterAdmin, served on loopback."""
    server = GrpcServer(ServerConfig(host="127.0.0.1", port=0), ["pdserve.v1.Router"])
    router_pb2_grpc.add_RouterServicer_to_server(servicer, server.server)
    router_pb2_grpc.add_RouterAdminServicer_to_server(
        RouterAdminServicer(_Directory(), servicer.stats, servicer.inflight), server.server)
    await server.start()
    try:
        # BDP probing off: the client's window stays at HTTP/2's 64 KiB, as one whose reads
        # stopped before gRPC grew it (tests/test_serving_stalled_client.py).
        async with grpc.aio.insecure_channel(server.address,
                                             options=[("grpc.http2.bdp_probe", 0)]) as channel:
            return await body(channel, router_pb2_grpc.RouterAdminStub(channel))
    finally:
        await server.server.stop(0)


async def _stop_reading(servicer: RouterServicer, channel: grpc.aio.Channel):
    """A Generate call whose client read one chunk, then nothing: once the router's write to
    it has been stuck for half a second (the window is shut)."""
    call = router_pb2_grpc.RouterStub(channel).Generate(REQUEST)
    await call.read()
    writing = 0  # polls in a row that found the handler in a write (one takes microseconds)
    while writing < 10:
        await asyncio.sleep(0.05)
        writing = writing + 1 if servicer.inflight._by_id["r1"].writing else 0
    return call


def _access_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "pdserve.access"]


@pytest.mark.timeout(60)  # a status that never came would hang it
def test_an_operator_cancel_of_a_client_that_stopped_reading_ends_its_call_with_a_status(
        caplog):
    """The write never returns: the grace's end gives it up, as --client-write-timeout-s
    does. Cancelling the handler's task there ended the call with no status, and the client,
    reading on, waited for one for ever."""
    caplog.set_level(logging.INFO, logger="pdserve.access")
    servicer = _stalled_reader_servicer()

    async def body(channel, admin):
        call = await _stop_reading(servicer, channel)
        await admin.CancelRequest(router_pb2.CancelRequestRequest(request_id="r1"))
        while len(servicer.inflight):  # the grace passes, the write still stuck
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while await call.read() is not grpc.aio.EOF:
                pass  # what the window and the buffers held, then the status
        return err.value

    err = asyncio.run(_serve(servicer, body))
    assert err.code() == grpc.StatusCode.CANCELLED
    assert err.details() == "cancelled by the router's operator"
    assert len(servicer.inflight) == 0
    # The access log says who ended it (it said the client).
    [line] = _access_lines(caplog)
    assert "status=CANCELLED" in line and "error=\"cancelled by the router's operator\"" in line


def test_a_client_that_cancels_while_its_write_waits_is_no_fault_in_the_log(caplog):
    """The write to a client that stopped reading fails when it cancels, before gRPC cancels
    the handler: the net under a handler's own cancels (engine/stray_cancels.py) took that for
    one, and logged the normal end of a client's cancel as an ERROR with a traceback."""
    caplog.set_level(logging.DEBUG)
    servicer = _stalled_reader_servicer()

    async def body(channel, admin):
        call = await _stop_reading(servicer, channel)
        call.cancel()
        # The handler's end: the net's log, if any, comes in the same step.
        while not _access_lines(caplog):
            await asyncio.sleep(0.05)

    asyncio.run(_serve(servicer, body))
    [line] = _access_lines(caplog)
    assert "status=CANCELLED" in line and 'error="cancelled by the client"' in line
    faults = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not faults, [r.getMessage() for r in faults]


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
