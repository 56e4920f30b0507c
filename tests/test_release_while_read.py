"""The router's ReleaseKV for a request cut while a decode worker may be pulling its KV, and the
prefill worker's answer to it: the blocks must not be reused under that read.

The decode worker commits what its pull read, and registers the prompt's block hashes with it,
unless the router's cut reaches it before its pull ends; the cut travels on another connection
(with the default multiplexed decode stream, queued behind that stream's other messages) than
the ReleaseKV. Freed at once, the blocks could be given to another prompt and overwritten under
the read, and the decode worker's prefix cache would serve that other prompt's KV under this
prompt's hashes (tests/test_kvtransfer_engine.py shows a late read being served, and cached,
as is). The router's request path in process, its workers replaced by stubs; the prefill
servicer in process over a scripted engine (as tests/test_prefill_release.py)."""
from __future__ import annotations

import asyncio
import contextlib
import time
import types

import grpc
import pytest

from engine.call_abort import KV_SOURCE_FAILED, REFUSED
from protos import common_pb2, worker_pb2
from router.directory import WorkerHandle
from router.migration import RequestRun
from router.worker_handle import CountedStream
from tests.test_prefill_release import _Engine, _servicer as _prefill_servicer
from tests.test_router_cancel import REQUEST, _Context, _Directory, _servicer


class _PrefillStub:
    def __init__(self) -> None:
        self.releases: list[worker_pb2.ReleaseKVRequest] = []

    async def Prefill(self, request, timeout):
        return worker_pb2.PrefillResponse(first_token_id=7, kv_handle=common_pb2.KVHandle(
            worker_id="prefill-x", lease_id=request.request_id, lease_timeout_s=30.0))

    async def ReleaseKV(self, request, timeout):
        self.releases.append(request)
        return worker_pb2.ReleaseKVResponse(released=True)


class _DecodeStub:
    """A decode worker's ForgetLease: ``reading`` is its answer; None, a lost call."""

    def __init__(self, reading: bool | None) -> None:
        self.reading = reading
        self.forgets: list[worker_pb2.ForgetLeaseRequest] = []

    async def ForgetLease(self, request, timeout):
        self.forgets.append(request)
        if self.reading is None:
            raise _error(grpc.StatusCode.UNAVAILABLE)
        return worker_pb2.ForgetLeaseResponse(may_be_reading=self.reading)


class _Decodes(_Directory):
    """Every decode leg goes to one worker whose legs play ``leg`` (an async generator)."""

    def __init__(self, leg, reading: bool | None) -> None:
        self.leg = leg
        self.opened = asyncio.Event()
        self.stub = _DecodeStub(reading)
        self.decode = WorkerHandle(common_pb2.WorkerInfo(worker_id="decode-x", role="decode"),
                                   None, None, self.stub)

    async def pick_decode(self, num_tokens, avoid):
        return self.decode

    def hold_inflight(self, worker):
        return lambda: None

    watched = _Directory.in_use

    def open(self):
        self.opened.set()
        return self.leg()


def _error(code: grpc.StatusCode, marks=()) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*marks), "x")


async def _pulling():  # a pull that has not ended when the request is cut
    await asyncio.Event().wait()
    yield  # pragma: no cover


async def _streaming():  # pulled and committed: its first chunk came, then the cut
    yield worker_pb2.DecodeChunk(token_ids=[8])
    await asyncio.Event().wait()


def _failing(error):
    async def leg():
        raise error
        yield  # pragma: no cover
    return leg


def _release_after_cut(leg, cut_in_decode: bool = True, source_hung: bool = False,
                       reading: bool | None = True, forgets: list | None = None) -> list[bool]:
    """``may_be_read`` of each ReleaseKV the router sent for the attempt, cut (the client's
    cancel, its deadline) once its decode leg is open, or before it when not ``cut_in_decode``
    (a leg that fails ends the request by itself), or by the router's health checks judging
    the prefill worker hung when ``source_hung``. ``reading``: the decode worker's answer
    to ForgetLease (None: the call fails); the ForgetLease requests go to ``forgets``."""
    servicer = _servicer()
    directory = _Decodes(leg, reading)
    servicer.directory = directory
    servicer._decode = lambda dreq, decode, context, run: CountedStream(lambda: None,
                                                                        directory.open())
    stub = _PrefillStub()
    prefill = WorkerHandle(common_pb2.WorkerInfo(worker_id="prefill-x", role="prefill"),
                           None, stub, None)
    run = RequestRun("r9", [11, 12, 13], time.monotonic())

    async def body():
        chunks = servicer._remote_prefill(run, REQUEST, prefill, frozenset(), _Context(),
                                          lambda: None)
        await anext(chunks)  # the first token, from the prefill
        if cut_in_decode:
            rest = asyncio.ensure_future(_drain(chunks))
            await directory.opened.wait()
            if source_hung:
                assert prefill.calls.cut_all("health checks unanswered") == 1
            for _ in range(5):  # the leg's first chunk, if it has one, reaches the client
                await asyncio.sleep(0)
            rest.cancel()
            with contextlib.suppress(BaseException):
                await rest
        else:
            await chunks.aclose()
        await asyncio.gather(*servicer._release_tasks)

    asyncio.run(body())
    assert [r.request_id for r in stub.releases] == [run.attempt_id] * len(stub.releases)
    if forgets is not None:
        forgets.extend(directory.stub.forgets)
    return [r.may_be_read for r in stub.releases]


async def _drain(chunks) -> None:
    async for _ in chunks:
        pass


def test_a_request_cut_while_its_decode_worker_pulls_leaves_the_blocks_to_the_reader():
    assert _release_after_cut(_pulling) == [True]


def test_a_request_cut_before_its_decode_worker_met_the_lease_frees_the_blocks_at_once():
    """A per-request Decode call cut a moment after it was opened may never have left: the
    decode worker, asked, says it never met the lease (and refuses it from now on), so the
    blocks need not wait for a reader that will not come, nor for the lease's expiry."""
    forgets: list = []
    assert _release_after_cut(_pulling, reading=False, forgets=forgets) == [False]
    assert [f.lease_id for f in forgets] == [forgets[0].lease_id] and forgets[0].lease_id
    assert 0 < forgets[0].lease_timeout_s <= 30.0  # what is left of the handle's lease
    # A worker that does not answer may be reading: left to it, or to the expiry.
    assert _release_after_cut(_pulling, reading=None) == [True]


def test_a_leg_cut_for_a_hung_prefill_worker_leaves_the_blocks_to_the_reader():
    """The router's own cut, marked as the KV source's failure for the migration to blame
    it, is no word from the decode worker that its pull ended: a prefill worker whose event
    loop stalled (unanswered health checks) still serves one-sided reads, and frees the
    blocks once it takes the ReleaseKV, maybe under a read the cut has not stopped yet."""
    assert _release_after_cut(_pulling, source_hung=True) == [True]


def test_a_request_cut_before_its_decode_leg_or_after_its_pull_frees_the_blocks_at_once():
    forgets: list = []
    assert _release_after_cut(_pulling, cut_in_decode=False, forgets=forgets) == [False]
    assert _release_after_cut(_streaming, forgets=forgets) == [False]
    assert forgets == []  # no decode worker to ask: none may be reading


@pytest.mark.parametrize("error, may_be_read", [
    # The worker's own word: its pull failed (and it commits nothing), or it took nothing.
    (_error(grpc.StatusCode.UNAVAILABLE, KV_SOURCE_FAILED), False),
    (_error(grpc.StatusCode.RESOURCE_EXHAUSTED, REFUSED), False),
    (_error(grpc.StatusCode.RESOURCE_EXHAUSTED), False),  # no room: before any block was read
    # A lost call: the worker may be pulling still.
    (_error(grpc.StatusCode.UNAVAILABLE), True),
])
def test_a_decode_leg_that_failed_frees_the_blocks_unless_a_read_may_go_on(error, may_be_read):
    assert _release_after_cut(_failing(error)) == [may_be_read]


def _release(svc, rid: str, may_be_read: bool):
    return svc.ReleaseKV(worker_pb2.ReleaseKVRequest(request_id=rid, may_be_read=may_be_read),
                         None)


def test_a_release_that_a_read_may_follow_holds_the_blocks_until_the_reader_releases_them():
    """The prefill worker side: the lease stays (the engine is not told to free its blocks)
    until the reader's own release, which its pull sends once its read has ended, or the
    lease's expiry; a release without a reader frees them at once."""
    async def run():
        engine = _Engine()
        engine.go.set()
        svc = _prefill_servicer(engine)
        for rid in ("read", "unread"):
            resp = await svc._prefill(worker_pb2.PrefillRequest(
                request_id=rid, prompt_token_ids=list(range(5, 25))))
            assert resp.HasField("kv_handle")
        answer = await _release(svc, "read", may_be_read=True)
        assert not answer.released and engine.released == [] and "read" in svc._leases
        assert (await _release(svc, "unread", may_be_read=False)).released
        assert engine.released == ["unread"]
        svc._lease_ended("read")  # the engine ended the lease: the reader's release came
        assert "read" not in svc._leases and svc.num_releases_deferred == 1
    asyncio.run(run())


class _Allocating:
    """A decode engine whose allocation waits until the request is cut."""

    def __init__(self) -> None:
        self.allocating = asyncio.Event()

    async def allocate_prefilled(self, *args):
        self.allocating.set()
        await asyncio.Event().wait()


def test_a_decode_worker_cut_before_its_pull_tells_the_owner_it_will_not_read():
    """Else the prefill worker, told by the router that a read may be on its way, would hold
    the blocks until the lease expires."""
    from decode_svc.service import DecodeServicer
    from tests.test_kv_peers import _handles

    told = []
    engine = _Allocating()
    rt = types.SimpleNamespace(
        engine=engine, registry=None, on_drain=[], worker_id="decode-x",
        record_transfer=lambda ev: None,
        llm=types.SimpleNamespace(release_unread_kv=lambda remotes, lease: told.append(
            ([r.agent_name for r in remotes], lease))),
        config=types.SimpleNamespace(engine=types.SimpleNamespace(
            kv_transfer_backend="torch", block_size=16, kv_transfer_timeout_s=30.0)))
    svc = DecodeServicer(rt)
    request = worker_pb2.DecodeRequest(
        request_id="d1", prompt_token_ids=list(range(5, 25)), first_token_id=7,
        kv_handle=common_pb2.KVHandle(worker_id="prefill-x", backend="torch", block_size=16,
                                      rank_handles=_handles("owner"), block_ids=[3, 4],
                                      num_tokens=20, lease_timeout_s=30.0, lease_id="p1"))

    async def run():
        chunks = svc.decode(request, lambda: None)
        call = asyncio.ensure_future(anext(chunks))
        await engine.allocating.wait()
        call.cancel()  # the router's cut, or the call's deadline
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.gather(*svc._releases)
    asyncio.run(run())
    assert told == [(["owner"], "p1")]


def _decode_servicer(engine, told: list):
    from decode_svc.service import DecodeServicer
    rt = types.SimpleNamespace(
        engine=engine, registry=None, on_drain=[], worker_id="decode-x", draining=False,
        admit=contextlib.nullcontext, record_transfer=lambda ev: None,
        llm=types.SimpleNamespace(release_unread_kv=lambda remotes, lease: told.append(
            ([r.agent_name for r in remotes], lease))),
        config=types.SimpleNamespace(engine=types.SimpleNamespace(
            kv_transfer_backend="torch", block_size=16, kv_transfer_timeout_s=30.0)))
    return DecodeServicer(rt)


def _pulled_request(rid: str = "d1") -> worker_pb2.DecodeRequest:
    from tests.test_kv_peers import _handles
    return worker_pb2.DecodeRequest(
        request_id=rid, prompt_token_ids=list(range(5, 25)), first_token_id=7,
        kv_handle=common_pb2.KVHandle(worker_id="prefill-x", backend="torch", block_size=16,
                                      rank_handles=_handles("owner"), block_ids=[3, 4],
                                      num_tokens=20, lease_timeout_s=30.0, lease_id="p1"))


def test_a_multiplexed_start_cancelled_before_it_ran_tells_the_owner_it_will_not_read():
    """A cancel read in the same tick as its start cancels a task that never entered
    decode(): without a word the lease the router left to it stayed held until expiry."""
    from decode_svc import mux

    told: list = []
    svc = _decode_servicer(_Allocating(), told)

    async def controls():  # no await between them: one tick of the reader
        yield worker_pb2.DecodeControl(start=worker_pb2.DecodeStart(request=_pulled_request()))
        yield worker_pb2.DecodeControl(cancel="d1")

    async def run():
        m = mux._DecodeMux(servicer=svc)
        await m.read(controls())
        async with asyncio.timeout(10):
            assert [b async for b in m.batches()] == []
        await asyncio.gather(*svc._releases)
        return m

    m = asyncio.run(run())
    assert m.tasks == {} and m.unstarted == {}
    assert told == [(["owner"], "p1")]


def test_a_start_whose_handle_does_not_fit_this_worker_tells_no_one_when_cancelled():
    """The word frees whatever lease the handle names: only a handle a pull would have read
    (here, one for another KV transfer backend) is told about."""
    told: list = []
    svc = _decode_servicer(_Allocating(), told)
    request = _pulled_request()
    request.kv_handle.backend = "nixl"

    async def run():
        svc.release_unstarted(request)
        await asyncio.gather(*svc._releases)

    asyncio.run(run())
    assert told == []


class _FailingAllocation:
    """A decode engine whose allocation fails with ``error``."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def allocate_prefilled(self, *args):
        raise self.error


def _allocation_errors():
    from engine.engine_front import EngineDeadError
    from engine.kv_cache_manager import NoFreeBlocksError
    from engine.worker_runtime import RejectError
    return [
        # Errors the router cannot place: it leaves the lease to this worker's word.
        (EngineDeadError("the engine died"), True),
        (RuntimeError("a bug"), True),
        # It frees the lease itself (a refusal), or hands it to another decode worker (no
        # room), whose read this worker's word must not free the blocks under.
        (RejectError(grpc.StatusCode.UNAVAILABLE, "draining"), False),
        (NoFreeBlocksError("no room"), False),
        # A duplicate call's: the same request may be pulling this lease here.
        (ValueError("request id 'd1' is already in the engine"), False),
    ]


@pytest.mark.parametrize("error, tells", _allocation_errors())
def test_a_decode_worker_whose_allocation_failed_tells_the_owner_it_will_not_read(error, tells):
    """Without the word, the router's ReleaseKV (may_be_read: an error it cannot place) left
    the blocks held until the lease expired."""
    told: list = []
    svc = _decode_servicer(_FailingAllocation(error), told)

    async def run():
        with pytest.raises(type(error)):
            await anext(svc.decode(_pulled_request(), lambda: None))
        await asyncio.gather(*svc._releases)

    asyncio.run(run())
    assert told == ([(["owner"], "p1")] if tells else [])
