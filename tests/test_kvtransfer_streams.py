"""NIXL pulls split over parallel streams (``pull_streams`` > 1): exact bytes, release
notifications after every share landed, heterogeneous TP, dead owners, and the bookkeeping that
decides whether a failed pull's bytes may still land."""
from __future__ import annotations

import concurrent.futures
import os
import random
import signal
import time

import numpy as np
import pytest
import torch

from kvtransfer import PeerGoneError, TransferError, TransferTimeout, make_agent
from kvtransfer import nixl_agent as nixl_mod
from kvtransfer import nixl_reader as reader_mod
from kvtransfer.nixl_reader import join_streams
from kvtransfer.plan import split_runs
from tests.kv_owner_proc import pull_concurrently
from tests.proc_signals import stop_process, wait_until
from tests.test_kvtransfer import BASE, BIG, Owner, rank_layout


@pytest.fixture
def owners():
    made: list[Owner] = []

    def make(layout, seed: int) -> Owner:
        made.append(Owner(layout, seed, "nixl"))
        return made[-1]

    yield make
    for o in made:
        o.kill()


@pytest.fixture
def split_all(monkeypatch):
    monkeypatch.setattr(nixl_mod, "SPLIT_MIN_BYTES", 0)  # tiny test pulls split too


def _reader(layout, streams: int):
    cache = torch.zeros(layout.shape, dtype=torch.float32)
    agent = make_agent("nixl", cache, layout, pull_streams=streams)
    shares: list[int] = []  # descriptors handed to the streams

    for s in agent._streams:
        submit = s.submit

        def counted(parts, deadline, submit=submit):
            shares.append(sum(len(p.rdesc) for p in parts))
            return submit(parts, deadline)

        s.submit = counted
    return agent, cache, shares


@pytest.mark.parametrize("streams", [2, 3])
def test_split_pulls_arrive_exactly_and_release_after(owners, split_all, streams):
    owner = owners(BASE, 21)
    agent, cache, shares = _reader(BASE, streams)
    rng = random.Random(streams)
    try:
        for _ in range(4):
            n = rng.randint(streams, 10)  # a block is one run: a share per stream
            src = [rng.randrange(BASE.num_blocks) for _ in range(n)]
            dst = rng.sample(range(BASE.num_blocks), n)
            stats = agent.pull([owner.handle], src, dst, timeout_s=20.0)
            assert torch.equal(cache[dst], owner.cache[src])
            assert stats.num_descriptors == n  # one run per block, none cut in two
        agent.pull([owner.handle], [10, 11, 12], [0, 1, 2], timeout_s=20.0, notify=b"release:s")
        counters = agent.counters()
    finally:
        agent.close()
    assert torch.equal(cache[[0, 1, 2]], owner.cache[[10, 11, 12]])
    assert len(shares) == 5 * (streams - 1) and all(s > 0 for s in shares)
    assert owner.next_notification() == "release:s"
    assert (counters.transfers, counters.failures, counters.notifications_sent) == (5, 0, 1)


def test_small_pulls_stay_on_the_callers_thread(owners):
    owner = owners(BASE, 22)
    agent, cache, shares = _reader(BASE, 2)
    try:
        agent.pull([owner.handle], [1, 2], [3, 4], timeout_s=20.0)  # far below 8 MB
    finally:
        agent.close()
    assert shares == []
    assert torch.equal(cache[[3, 4]], owner.cache[[1, 2]])


def test_split_pulls_from_tp2_owner_and_at_once(owners, split_all):
    ranks = [owners(rank_layout(r, 2), 30 + r) for r in range(2)]
    agent, cache, shares = _reader(BASE, 2)
    jobs = [([0, 7, 9], [4, 5, 6]), ([1, 2, 3, 4], [10, 11, 12, 13]), ([20], [0])]
    errors = pull_concurrently(agent, [o.handle for o in ranks], jobs, "t", timeout_s=30.0)
    assert errors == []
    for src, dst in jobs:
        for r, o in enumerate(ranks):
            assert torch.equal(cache[dst][..., 2 * r:2 * r + 2, :], o.cache[src])
    assert sorted(ranks[0].next_notification() for _ in jobs) == [f"release:t{i}"
                                                                 for i in range(3)]
    assert shares  # the streams carried part of it


def test_split_pull_from_a_dead_owner_fails_within_the_timeout(owners, split_all):
    owner = owners(BIG, 23)
    agent, _, _ = _reader(BIG, 2)
    try:
        agent.pull([owner.handle], list(range(40)), list(range(40)), timeout_s=20.0)
        owner.kill()
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            agent.pull([owner.handle], list(range(200)), list(range(200)), timeout_s=3.0)
        assert time.monotonic() - t0 < 30  # the timeout plus UCX's own error path
        assert agent.counters().failures == 1
    finally:
        agent.close()


def _future(exc: BaseException | None = None) -> concurrent.futures.Future:
    f: concurrent.futures.Future = concurrent.futures.Future()
    if exc is None:
        f.set_result(None)
    else:
        f.set_exception(exc)
    return f


def test_join_streams_keeps_the_first_error_and_any_landing_writes():
    deadline = time.monotonic() + 1
    assert join_streams([_future(), _future()], deadline, None) is None
    late = TransferTimeout("stream", writes_may_land=True)
    main = PeerGoneError("main")
    assert join_streams([_future(late)], deadline, main) is main and main.writes_may_land
    assert join_streams([_future(), _future(late)], deadline, None) is late
    bug = join_streams([_future(KeyError("x"))], deadline, None)
    assert type(bug) is TransferError and bug.writes_may_land


def test_join_streams_marks_a_stuck_share(monkeypatch):
    monkeypatch.setattr(reader_mod, "_STREAM_GRACE_S", 0.05)
    stuck: concurrent.futures.Future = concurrent.futures.Future()  # never finishes
    stuck.set_running_or_notify_cancel()  # its thread took it
    err = join_streams([stuck], time.monotonic(), None)
    assert isinstance(err, TransferTimeout) and err.writes_may_land


def test_join_streams_cancels_a_share_still_queued_at_the_deadline():
    queued: concurrent.futures.Future = concurrent.futures.Future()  # no thread took it yet
    err = join_streams([queued], time.monotonic(), None)
    assert isinstance(err, TransferTimeout) and not err.writes_may_land
    assert queued.cancelled()  # its stream's thread will never post it


def test_a_share_queued_behind_a_stalled_pull_never_writes(owners, split_all, monkeypatch):
    """A stream's thread serves one share at a time: a pull's share queued behind a share
    reading from a stalled owner is given up at its pull's deadline and never posted. It was
    posted once its turn came, long after its pull had failed, into blocks the engine had
    handed on by then."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # a stopped owner serves no reads (not over shm)
    stalled, good = owners(BASE, 31), owners(BASE, 32)
    agent, cache, _ = _reader(BASE, 2)
    try:
        agent.preconnect(stalled.handle)
        agent.preconnect(good.handle)
        stop_process(stalled.proc)
        errors: list[BaseException] = []

        def stuck():
            try:
                agent.pull([stalled.handle], [0, 1], [0, 1], timeout_s=3.0)
            except TransferError as e:
                errors.append(e)

        stream = agent._streams[0].reader
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            first = ex.submit(stuck)
            # Its second share holds the stream's thread: posted, its READ in flight (until
            # its pull's deadline, the owner being stopped).
            assert wait_until(lambda: _reads_in_flight(stream, stalled.handle) == 1, 10)
            with pytest.raises(TransferTimeout) as err:
                agent.pull([good.handle], [4, 5], [10, 11], timeout_s=1.0)
            assert not err.value.writes_may_land
            assert not first.done()  # it failed by its own deadline, not the stuck one's
            cache[10:12] = -1.0  # the blocks were handed on
            first.result(timeout=30)
        assert isinstance(errors[0], TransferTimeout)
        agent.close()  # waits for the streams' threads: whatever was queued has run
        assert bool((cache[10:12] == -1.0).all())
    finally:
        os.kill(stalled.proc.pid, signal.SIGCONT)


def _reads_in_flight(reader, remote) -> int:
    with reader.lock:
        peer = reader._peers.get(remote.agent_name)
        return 0 if peer is None else peer.reads_in_flight


def test_split_runs_balances_bytes_without_cutting_runs():
    assert split_runs(np.ones(16), 2) == [slice(0, 8), slice(8, 16)]
    assert split_runs(np.array([10, 1, 1]), 2) == [slice(0, 1), slice(1, 3)]
    assert split_runs(np.array([5]), 3) == [slice(0, 0), slice(0, 1), slice(1, 1)]
    assert split_runs(np.zeros(0), 2) == [slice(0, 0), slice(0, 0)]
    sl = split_runs(np.arange(1, 101), 4)
    assert sl[0].start == 0 and sl[-1].stop == 100
    assert all(a.stop == b.start for a, b in zip(sl, sl[1:]))
    with pytest.raises(ValueError, match="positive"):
        split_runs(np.ones(3), 0)


def test_pull_streams_setting(monkeypatch):
    monkeypatch.delenv("PDSERVE_NIXL_PULL_STREAMS", raising=False)
    assert nixl_mod.pull_streams_setting(None) == 1
    monkeypatch.setenv("PDSERVE_NIXL_PULL_STREAMS", "3")
    assert nixl_mod.pull_streams_setting(None) == 3
    assert nixl_mod.pull_streams_setting(2) == 2
    for bad in (0, 17, True, 2.0):
        with pytest.raises(ValueError, match="pull_streams"):
            nixl_mod.pull_streams_setting(bad)
    monkeypatch.setenv("PDSERVE_NIXL_PULL_STREAMS", "two")
    with pytest.raises(ValueError, match="PDSERVE_NIXL_PULL_STREAMS"):
        nixl_mod.pull_streams_setting(None)
    with pytest.raises(ValueError, match="NIXL option"):
        make_agent("torch", torch.zeros(BASE.shape), BASE, pull_streams=2)


def test_engine_config_sets_the_agents_streams_and_progress(preset_path):
    from engine import EngineConfig, LLMEngine

    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), num_gpu_blocks=16,
                                    role="decode", kv_transfer_backend="nixl", kv_pull_streams=2))
    try:
        assert engine.executor.kv_agent.pull_streams == 2
        # Nobody reads a decode engine's cache: its owner-side progress idles.
        assert not engine.executor.kv_agent._serves_reads
    finally:
        engine.shutdown()
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), num_gpu_blocks=16,
                                    role="prefill", kv_transfer_backend="nixl"))
    try:
        assert engine.executor.kv_agent._serves_reads
    finally:
        engine.shutdown()
