"""A NIXL reader's close with reads in flight, and a READ whose post fails: every transfer
handle is released, and the cache stays registered until no read uses it."""
from __future__ import annotations

import concurrent.futures
import gc
import os
import signal
import weakref

import pytest
import torch

from kvtransfer import PeerGoneError, TransferError, TransferTimeout, make_agent
from tests.proc_signals import stop_process, wait_until
from tests.kv_owner_proc import seeded_cache
from tests.test_kvtransfer import BASE, Owner


@pytest.fixture
def owner():
    made = Owner(BASE, 41, "nixl")
    yield made
    made.kill()


def _spy(reader, calls: list, *names: str) -> None:
    """Records the calls ``names`` of ``reader``'s NIXL agent, in order: (name, first
    argument, reader)."""
    for name in names:
        real = getattr(reader.agent, name)

        def spied(*args, real=real, name=name):
            calls.append((name, args[0] if args else None, reader))
            return real(*args)

        setattr(reader.agent, name, spied)


@pytest.mark.parametrize("streams", [1, 2])
def test_a_close_ends_the_reads_in_flight_before_it_deregisters(owner, monkeypatch, streams):
    """Deregistered under a running READ, the cache could take its bytes once the engine
    freed it, and the read's next poll found no agent (a PeerGoneError about a NoneType);
    with streams, the close waited for the read's whole deadline."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # a stopped owner serves no reads (not over shm)
    from kvtransfer import nixl_agent as nixl_mod
    monkeypatch.setattr(nixl_mod, "SPLIT_MIN_BYTES", 0)  # the stream takes a share too
    cache = torch.zeros(BASE.shape, dtype=torch.float32)
    agent = make_agent("nixl", cache, BASE, pull_streams=streams)
    readers = [agent._main, *(s.reader for s in agent._streams)]
    calls: list = []
    for r in readers:
        _spy(r, calls, "transfer", "release_xfer_handle", "deregister_memory")
    agent.preconnect(owner.handle)
    stop_process(owner.proc)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            # A deadline past the wait below: only the close ends this pull in time.
            pull = ex.submit(agent.pull, [owner.handle], [0, 1, 2, 3], [0, 1, 2, 3],
                             timeout_s=120.0)
            assert wait_until(lambda: sum(_in_flight(r) for r in readers) == streams, 30)
            agent.close()
            with pytest.raises(TransferError, match="is closed") as err:
                pull.result(timeout=60)
        assert not isinstance(err.value, TransferTimeout)
        assert err.value.writes_may_land  # the owner never answered: the READ may land
        posted = [h for name, h, _ in calls if name == "transfer"]
        released = [h for name, h, _ in calls if name == "release_xfer_handle"]
        assert len(posted) == streams and sorted(map(id, released)) == sorted(map(id, posted))
        # Each reader deregistered its cache after it released its handles.
        for r in readers:
            names = [name for name, _, by in calls if by is r]
            assert names == ["transfer", "release_xfer_handle", "deregister_memory"]
        # A read refused once closed posted nothing: nothing may land, no wait to settle.
        assert all(r._settle([], 5.0) for r in readers)
    finally:
        os.kill(owner.proc.pid, signal.SIGCONT)


def test_a_read_whose_post_fails_releases_its_handle(owner):
    cache = torch.zeros(BASE.shape, dtype=torch.float32)
    agent = make_agent("nixl", cache, BASE)
    reader, calls = agent._main, []
    _spy(reader, calls, "initialize_xfer", "release_xfer_handle")
    prepared = []
    initialize = reader.agent.initialize_xfer

    def kept(*args):
        prepared.append(initialize(*args))
        return prepared[-1]

    reader.agent.initialize_xfer = kept

    def refuses(h):
        raise RuntimeError("UCX ran out of something")

    reader.agent.transfer = refuses
    try:
        with pytest.raises(PeerGoneError, match="UCX ran out of something"):
            agent.pull([owner.handle], [0, 1], [0, 1], timeout_s=30.0)
        assert [h for name, h, _ in calls if name == "release_xfer_handle"] == prepared
        with reader.lock:
            assert reader._peers[owner.handle.agent_name].reads_in_flight == 0
        del reader.agent.transfer  # the agent's own again: the next pull reads
        agent.pull([owner.handle], [0, 1], [0, 1], timeout_s=30.0)
        want = seeded_cache(BASE, 41)
        assert torch.equal(cache[:2], want[:2])  # [num_blocks, ...]: blocks lead
    finally:
        agent.close()


def _in_flight(reader) -> int:
    with reader.lock:
        return sum(p.reads_in_flight for p in reader._peers.values())


def test_a_reader_whose_read_failed_is_never_destroyed(owner):
    """A READ from a dead owner can stay queued inside UCX; destroying its agent then aborted
    the process (``ucs_arbiter_group_is_empty``, signal 6) at whatever garbage collection
    dropped it. Such an agent is kept for good; a reader whose reads all landed is not."""
    clean, failed = (make_agent("nixl", torch.zeros(BASE.shape), BASE) for _ in range(2))
    try:
        clean.pull([owner.handle], [0, 1], [0, 1], timeout_s=30.0)
        failed.pull([owner.handle], [0, 1], [0, 1], timeout_s=30.0)
        owner.kill()
        with pytest.raises(TransferError):
            failed.pull([owner.handle], [2, 3], [2, 3], timeout_s=5.0)
        assert (clean._main.read_failed, failed._main.read_failed) == (False, True)
        refs = [weakref.ref(a._main.agent) for a in (clean, failed)]
    finally:
        clean.close()
        failed.close()
    del clean, failed
    gc.collect()
    assert [r() is None for r in refs] == [True, False]
