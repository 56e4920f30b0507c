"""A worker's background threads wake only as often as they have work: every wake-up takes the
GIL from the engine thread, whose steps are the worker's throughput."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.kv_connector import _EXPIRE_EVERY_S, _POLL_S, RELEASE_PREFIX, KVConnector
from tests.proc_signals import wait_until


class _Agent:
    def __init__(self) -> None:
        self.polls = 0
        self.inbox: list[bytes] = []
        self.reads_due = None

    def expect_reads(self, reads_due) -> None:
        self.reads_due = reads_due

    def poll_notifications(self) -> list[bytes]:
        self.polls += 1
        msgs, self.inbox = self.inbox, []
        return msgs

    def send_notification(self, owner, msg: bytes) -> None:  # a failed pull's release
        raise AssertionError("these engines pull nothing, so they send no release")


class _Engine:
    """What KVConnector touches on an LLMEngine."""

    def __init__(self, role: str | None) -> None:
        self.config = SimpleNamespace(role=role)
        self.executor = SimpleNamespace(kv_agent=_Agent(), kv_handles=lambda: [])
        self.released: list[str] = []
        self.reclaims = 0
        self.num_leases = 0

    def release_kv(self, request_id: str) -> None:
        self.released.append(request_id)

    def reclaim_expired_leases(self) -> None:
        self.reclaims += 1


@pytest.fixture
def connector():
    made = []

    def make(role):
        engine = _Engine(role)
        made.append(KVConnector(engine))
        engine.kv_connector = made[-1]
        return engine

    yield make
    for c in made:
        c.close()


def test_a_prefill_engine_applies_a_release_soon(connector):
    engine = connector("prefill")
    # Soon: a prefill engine polls for releases far more often than expiries are checked.
    # (Bounds below are generous: on a loaded host the poll thread may wait to be scheduled.)
    assert engine.kv_connector._poll_interval() == _POLL_S < _EXPIRE_EVERY_S
    engine.executor.kv_agent.inbox.append(RELEASE_PREFIX + b"req-1")
    assert wait_until(lambda: engine.released == ["req-1"], 10)
    # Its thread polls between expiry checks, not only with them (as the other roles do).
    agent = engine.executor.kv_agent
    assert wait_until(lambda: agent.polls >= engine.reclaims + 2, 10)
    # Its agent expects reads exactly while the engine holds leased blocks.
    due = engine.executor.kv_agent.reads_due
    assert due() is False
    engine.num_leases = 2
    assert due() is True


@pytest.mark.parametrize("role", ["decode", None])
def test_engines_that_lease_nothing_poll_only_for_expiries(connector, role):
    engine = connector(role)
    agent = engine.executor.kv_agent
    assert agent.reads_due is None  # nobody reads from it
    # Its thread wakes at the expiry check's half-second beat, not the release poll's (it was
    # one poll every 5 ms).
    assert engine.kv_connector._poll_interval() == _EXPIRE_EVERY_S
    # Quarantines still end on an idle engine: the expiry check keeps its beat.
    assert wait_until(lambda: engine.reclaims >= 2, 10)
    # Every poll comes with an expiry check: at most one poll is ahead of its check (it may
    # be between the two now). Polls read first: checks only grow after that.
    polls = agent.polls
    assert polls <= engine.reclaims + 1, f"{polls} polls for {engine.reclaims} expiry checks"
