"""A failed pull's release notification, sent off the pull's thread (engine/kv_release_sender):
an owner that never answers holds one sender, never the caller nor a live owner's release;
what waits is bounded; close() leaves no sender behind. Real torch agents in this process and
a real TCP listener that accepts nothing (a stopped owner, as the kernel answers for it)."""
from __future__ import annotations

import functools
import json
import socket
import threading
from dataclasses import replace

import pytest

from engine import kv_release_sender
from engine.kv_release_sender import ReleaseSender
from tests.proc_signals import wait_until



@pytest.fixture
def agents(kv_agents):
    return functools.partial(kv_agents, "torch")


@pytest.fixture
def silent_owner(agents):
    """A torch handle whose control server and store accept connections (the kernel's
    backlog) and never answer: an owner stopped, or one whose host stopped answering."""
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    real = agents().handle()
    yield replace(real, agent_name="silent-owner", address=f"127.0.0.1:{port}",
                  metadata=json.dumps({"store_port": port}).encode())
    listener.close()


def _senders() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pdserve-kv-notify" and t.is_alive()]


def _told(owner, msg: bytes) -> bool:
    got = owner.poll_notifications()
    _told.seen.extend(got)
    return msg in _told.seen


_told.seen = []


def test_a_live_owner_is_told_while_another_never_answers(agents, silent_owner):
    reader, live = agents(), agents()
    sender = ReleaseSender(reader.send_notification)
    try:
        assert sender.submit(silent_owner, b"release:hung")  # returns at once
        assert sender.submit(live.handle(), b"release:live")
        _told.seen = []
        assert wait_until(lambda: _told(live, b"release:live"))
        # The silent owner's notification is still under way: it holds its own sender only.
        assert sender.num_pending() == 1
    finally:
        reader.close()  # wakes the send stuck in the silent owner's handshake
        sender.close()
    assert sender.num_pending() == 0
    assert wait_until(lambda: not _senders())


def test_notifications_for_one_owner_go_in_order_on_one_thread(agents):
    reader, live = agents(), agents()
    sender = ReleaseSender(reader.send_notification)
    msgs = [f"release:r{i}".encode() for i in range(20)]
    try:
        for m in msgs:
            assert sender.submit(live.handle(), m)
        assert len(_senders()) <= 1
        _told.seen = []
        assert wait_until(lambda: _told(live, msgs[-1]))
        assert _told.seen == msgs
    finally:
        sender.close()
    assert wait_until(lambda: not _senders())


def test_what_waits_is_bounded_and_close_drops_it(agents, silent_owner, monkeypatch):
    monkeypatch.setattr(kv_release_sender, "MAX_PENDING", 5)
    reader = agents()
    sender = ReleaseSender(reader.send_notification)
    try:
        took = [sender.submit(silent_owner, f"release:{i}".encode()) for i in range(7)]
        assert took == [True] * 5 + [False] * 2 and sender.num_dropped == 2
        assert len(_senders()) == 1  # one owner: one thread, however many wait for it
        sender.close(wait_s=0)
        assert not sender.submit(silent_owner, b"release:late")
        assert sender.num_pending() <= 5  # what no thread took yet is gone
    finally:
        reader.close()
        sender.close()
    assert sender.num_pending() == 0
    assert wait_until(lambda: not _senders())
