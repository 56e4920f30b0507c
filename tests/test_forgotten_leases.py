"""A decode worker's answer to ForgetLease (decode_svc/forgotten_leases.py): "may be reading"
while any read of the lease may still land, and otherwise a refusal of the lease to every
Decode still to come, for as long as the lease lasts and no longer."""
from __future__ import annotations

import asyncio
import threading
import types

import pytest

from decode_svc import forgotten_leases
from decode_svc.forgotten_leases import ForgetAnswer, LeaseForgotten, ReadLeases
from tests.test_release_while_read import _decode_servicer, _pulled_request


class _PullingEngine:
    """Allocates at once; the pull (rt.llm.pull_kv, in a thread) waits for ``go``."""

    def __init__(self) -> None:
        self.allocated: list[str] = []
        self.aborted: list[str] = []
        self.pulling = threading.Event()
        self.go = threading.Event()

    async def allocate_prefilled(self, rid, *args):
        self.allocated.append(rid)
        return types.SimpleNamespace(request_id=rid, num_cached_tokens=0)

    def abort(self, rid):
        self.aborted.append(rid)

    def pull_kv(self, alloc, remotes, block_ids, timeout, deadline, lease_id):
        self.pulling.set()
        assert self.go.wait(30)
        raise ConnectionError("the transfer failed")


def test_a_decode_cut_mid_pull_is_reading_until_its_pull_ends_then_the_lease_is_refused():
    """The cut ends the Decode while its pull still writes into the blocks: told "not read"
    then, the router would free the lease under that read."""
    engine = _PullingEngine()
    svc = _decode_servicer(engine, [])
    svc.rt.llm.pull_kv = engine.pull_kv
    svc.rt.kv_failures = 0

    async def run():
        try:
            await cut_mid_pull()
        finally:
            engine.go.set()  # a failed check leaves no thread waiting

    async def cut_mid_pull():
        call = asyncio.ensure_future(anext(svc.decode(_pulled_request("d1"), lambda: None)))
        await asyncio.to_thread(engine.pulling.wait, 30)
        call.cancel()  # the router's cut
        with pytest.raises(asyncio.CancelledError):
            await call
        assert svc.leases.forget("p1", 30.0) is ForgetAnswer.READING  # the read may still land
        engine.go.set()
        async with asyncio.timeout(30):
            while engine.aborted != ["d1"]:  # the pull ended, and its blocks went back
                await asyncio.sleep(0.01)
        assert svc.leases.forget("p1", 30.0) is ForgetAnswer.FORGOTTEN  # nothing more read here
        with pytest.raises(LeaseForgotten):  # a Decode still to come reads nothing
            await anext(svc.decode(_pulled_request("d2"), lambda: None))
        assert engine.allocated == ["d1"]

    asyncio.run(run())


def test_forgotten_leases_last_as_long_as_the_lease_and_are_bounded(monkeypatch):
    now = [100.0]
    leases = ReadLeases(clock=lambda: now[0])
    assert leases.forget("a", 10.0) is ForgetAnswer.FORGOTTEN
    with pytest.raises(LeaseForgotten):
        leases.enter("a")
    now[0] += 10.0 + forgotten_leases.FORGET_MARGIN_S + 0.1  # past the lease, and its margin
    leases.enter("a").end()  # read as any lease is
    with pytest.raises(ValueError):
        leases.forget("b", float("nan"))
    monkeypatch.setattr(forgotten_leases, "MAX_FORGOTTEN", 2)
    assert leases.forget("b", 10.0) is leases.forget("c", 20.0) is ForgetAnswer.FORGOTTEN
    # no room: not refused, so left to the reader or expiry
    assert leases.forget("d", 10.0) is ForgetAnswer.NO_ROOM
    leases.enter("d").end()
    now[0] += 10.0 + forgotten_leases.FORGET_MARGIN_S + 0.1  # "b" ended: its room is free
    assert leases.forget("d", 10.0) is ForgetAnswer.FORGOTTEN
    with pytest.raises(LeaseForgotten):
        leases.enter("c")


class _RefusingAfterAsked:
    """Allocates once ``go`` is set, then fails with ``error`` (no room, or a duplicate's
    INVALID_ARGUMENT): the Decode ends before any read was posted."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.allocating = asyncio.Event()
        self.go = asyncio.Event()

    async def allocate_prefilled(self, rid, *args):
        self.allocating.set()
        await self.go.wait()
        raise self.error


def _refusals():
    from engine.kv_cache_manager import NoFreeBlocksError
    return [NoFreeBlocksError("no room"), ValueError("request id 'd1' is already in the engine")]


@pytest.mark.parametrize("error", _refusals())
def test_a_decode_asked_about_and_ended_before_its_pull_tells_the_owner(error):
    """The router's ForgetLease can overtake its cut (on the multiplexed stream the cancel waits
    behind the stream's other messages): "may be reading", so its ReleaseKV leaves the lease to
    this worker's word. A Decode that then fails before its pull (no room, which the cut came
    too late to turn into a cancel) sent none: the router, which asked, hands the lease to no
    one else, yet the blocks stayed held until the lease expired. The lease is refused here
    from then on, as one never met is, so the word frees no blocks under a later read."""
    told: list = []
    engine = _RefusingAfterAsked(error)
    svc = _decode_servicer(engine, told)

    async def run():
        call = asyncio.ensure_future(anext(svc.decode(_pulled_request("d1"), lambda: None)))
        await engine.allocating.wait()
        # the router's question, ahead of its cancel
        assert svc.leases.forget("p1", 30.0) is ForgetAnswer.READING
        engine.go.set()
        with pytest.raises(type(error)):
            await call
        await asyncio.gather(*svc._releases)
        with pytest.raises(LeaseForgotten):
            await anext(svc.decode(_pulled_request("d2"), lambda: None))

    asyncio.run(run())
    assert told == [(["owner"], "p1")]


def test_a_decode_ending_before_its_pull_is_silent_while_another_holds_the_lease():
    """Two Decodes with one lease here (a duplicate call): the one that fails before its pull
    must not tell the owner while the other may still read, even after a ForgetLease."""
    leases = ReadLeases()
    first, second = leases.enter("a"), leases.enter("a")
    assert leases.forget("a", 10.0) is ForgetAnswer.READING
    assert not second.end()  # "a" is still read by ``first``
    assert first.end()  # the last reader of a lease its caller asked about
    with pytest.raises(LeaseForgotten):
        leases.enter("a")
    unasked = leases.enter("b")
    assert not unasked.end()  # nobody asked: the lease is left to its router, as before


def test_the_forget_lease_call_answers_and_counts_each_answer_apart(monkeypatch):
    """A full table answers "may be reading" as a read does, yet no read is under way: the
    worker's stats tell the two apart, or a table too small for the load hides as reads."""
    from protos import worker_pb2

    svc = _decode_servicer(_PullingEngine(), [])
    counted = ("leases_forgotten", "leases_forget_reading", "leases_forget_no_room")
    for name in counted:
        setattr(svc.rt, name, 0)
    monkeypatch.setattr(forgotten_leases, "MAX_FORGOTTEN", 1)

    async def ask(lease_id: str) -> bool:
        answer = await svc.ForgetLease(worker_pb2.ForgetLeaseRequest(
            lease_id=lease_id, lease_timeout_s=10.0), None)
        return answer.may_be_reading

    async def run():
        reading = svc.leases.enter("read")
        answers = [await ask("a"), await ask("read"), await ask("b")]
        reading.end()
        return answers

    assert asyncio.run(run()) == [False, True, True]
    assert [getattr(svc.rt, name) for name in counted] == [1, 1, 1]
