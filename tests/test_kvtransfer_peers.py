"""A reader's remote peers: which handle of an owner it believes, and letting go of owners that
left. NIXL agents here share one process (NIXL over UCX moves host memory within it as between
processes); the engine-level tests (tests/test_kvtransfer_engine.py) cover other processes."""
from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
import torch

from kvtransfer import KVAgentHandle, PeerGoneError, TransferTimeout
from tests.kv_owner_proc import SMALL_LAYOUT

pytest.importorskip("nixl")

LAYOUT = SMALL_LAYOUT


@pytest.fixture
def agents(kv_agents):
    return lambda seed=None: kv_agents("nixl", seed=seed)


def _moved(h: KVAgentHandle, by: int) -> KVAgentHandle:
    return replace(h, base_addr=h.base_addr + by)


def test_a_corrupted_handle_met_first_does_not_lock_out_the_owners_genuine_one(agents):
    owner, reader = agents(1), agents()
    good = owner.handle()
    with pytest.raises(PeerGoneError):  # outside the owner's registration: NIXL refuses it
        reader.pull([_moved(good, 1 << 30)], [0], [0], timeout_s=10.0)
    reader.pull([good], [2, 3], [4, 5], timeout_s=10.0)
    assert torch.equal(reader.cache[[4, 5]], owner.cache[[2, 3]])


def test_a_handle_moved_inside_the_registration_is_refused_once_a_read_confirmed_another(agents):
    owner, reader = agents(2), agents()
    good = owner.handle()
    reader.pull([good], [0], [0], timeout_s=10.0)
    # Block 0 of this handle is block 1 of the cache: readable, and wrong.
    with pytest.raises(PeerGoneError, match="describes a cache other than"):
        reader.pull([_moved(good, LAYOUT.bytes_per_block)], [0], [1], timeout_s=10.0)
    assert not reader.cache[1].any()


def test_the_registrys_handle_overrides_a_wrong_one_a_read_confirmed(agents):
    owner, reader = agents(3), agents()
    good, shifted = owner.handle(), _moved(owner.handle(), LAYOUT.bytes_per_block)
    reader.pull([shifted], [0], [0], timeout_s=10.0)  # succeeds, with block 1's bytes
    assert torch.equal(reader.cache[0], owner.cache[1])
    with pytest.raises(PeerGoneError, match="describes a cache other than"):
        reader.pull([good], [0], [0], timeout_s=10.0)
    assert reader.preconnect(good)  # what the owner published itself
    reader.pull([good], [6], [6], timeout_s=10.0)
    assert torch.equal(reader.cache[6], owner.cache[6])
    with pytest.raises(PeerGoneError, match="describes a cache other than"):
        reader.pull([shifted], [0], [0], timeout_s=10.0)


def test_a_handle_carrying_another_agents_metadata_is_refused(agents):
    a, b, reader = agents(4), agents(5), agents()
    forged = replace(a.handle(), agent_name=b.name)  # reads would go to a's cache
    with pytest.raises(PeerGoneError, match="carries the metadata of"):
        reader.pull([forged], [0], [0], timeout_s=10.0)
    assert reader.peer_names() == []
    for owner in (b, a):
        reader.pull([owner.handle()], [1], [1], timeout_s=10.0)
        assert torch.equal(reader.cache[1], owner.cache[1])
    assert reader.peer_names() == sorted([a.name, b.name])


def test_a_forgotten_owner_is_unloaded_and_read_again_on_demand(agents):
    owner, other, reader = agents(6), agents(7), agents()
    reader.pull([owner.handle()], [1], [1], timeout_s=10.0)
    reader.pull([other.handle()], [2], [2], timeout_s=10.0)
    assert reader.forget_peer(owner.name) is True
    assert reader.peer_names() == [other.name]
    assert reader.forget_peer("never-met") is True
    reader.pull([owner.handle()], [3], [3], timeout_s=10.0)  # connects again
    assert torch.equal(reader.cache[3], owner.cache[3])
    assert reader.peer_names() == sorted([owner.name, other.name])


def test_an_owner_is_not_forgotten_while_a_read_from_it_runs(agents, monkeypatch):
    import kvtransfer.nixl_agent as nixl_agent

    # An owner that never progresses: a read from it stays in flight until its deadline.
    monkeypatch.setattr(nixl_agent, "_OWNER_PROGRESS_S", 3600.0)
    monkeypatch.setattr(nixl_agent, "_OWNER_IDLE_PROGRESS_S", 3600.0)
    owner, reader = agents(8), agents()
    reader.preconnect(owner.handle())
    failed = []
    pulling = threading.Thread(target=lambda: _pull_expecting_timeout(reader, owner, failed))
    pulling.start()
    deadline = time.monotonic() + 10.0
    while not reader._main._peers[owner.name].reads_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    assert reader.forget_peer(owner.name) is False
    assert reader.peer_names() == [owner.name]
    pulling.join()
    assert failed == [True]
    assert reader.forget_peer(owner.name) is True
    assert reader.peer_names() == []


def _pull_expecting_timeout(reader, owner, failed: list) -> None:
    try:
        reader.pull([owner.handle()], [1], [1], timeout_s=1.5)
    except TransferTimeout:
        failed.append(True)
