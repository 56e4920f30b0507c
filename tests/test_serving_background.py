"""A worker's background threads wake only as often as they have work: every wake-up takes the
GIL from the engine thread, whose steps are the worker's throughput."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from engine.kv_connector import RELEASE_PREFIX, KVConnector
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
        return engine

    yield make
    for c in made:
        c.close()


def test_a_prefill_engine_applies_a_release_soon(connector):
    engine = connector("prefill")
    engine.executor.kv_agent.inbox.append(RELEASE_PREFIX + b"req-1")
    assert wait_until(lambda: engine.released == ["req-1"], 0.2)
    # Its agent expects reads exactly while the engine holds leased blocks.
    due = engine.executor.kv_agent.reads_due
    assert due() is False
    engine.num_leases = 2
    assert due() is True


@pytest.mark.parametrize("role", ["decode", None])
def test_engines_that_lease_nothing_poll_only_for_expiries(connector, role):
    engine = connector(role)
    assert engine.executor.kv_agent.reads_due is None  # nobody reads from it
    time.sleep(0.3)
    assert engine.executor.kv_agent.polls == 0  # was one poll every 5 ms
    # Quarantines still end on an idle engine: the expiry check keeps its half-second beat.
    assert wait_until(lambda: engine.reclaims >= 1, 1.5)
    assert engine.executor.kv_agent.polls <= 3
