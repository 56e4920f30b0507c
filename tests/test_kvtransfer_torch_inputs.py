"""The torch.distributed KV backend against owners that stall, lie or flood, and readers that
send malformed input: each fails with a clear error (ValueError for bad input, TransferError
for a peer's failure) within its timeout, never a hang, a crash or wrong bytes. Real owner
processes and threads, real gloo groups and TCPStores."""
from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import pytest
import torch

from engine.call_abort import KV_SOURCE_FAILED
from engine.kv_layout import KVCacheLayout
from engine.worker_runtime import failure_marks, status_for
from kvtransfer import (KVAgentHandle, PeerGoneError, TransferError, TransferTimeout,
                        make_agent, wire)
from kvtransfer.torch_owner import MAX_READER_WAIT_S, TorchOwnerServer, reader_timeout
from tests.kv_owner_proc import Standby, seeded_cache
from tests.proc_signals import reap, stop_process, wait_until

BASE = KVCacheLayout(num_layers=3, num_blocks=24, block_size=4, num_kv_heads=4, kv_head_start=0,
                     total_num_kv_heads=4, head_size=8, dtype="float32", tp_rank=0, tp_size=1)
# A hang is what these bounds catch: a pull's timeout plus this is never reached by a pull
# that keeps it, however loaded the machine.
MARGIN_S = 8.0


def rank_layout(tp_rank: int, tp_size: int) -> KVCacheLayout:
    per = BASE.total_num_kv_heads // tp_size
    return replace(BASE, num_kv_heads=per, kv_head_start=tp_rank * per, tp_rank=tp_rank,
                   tp_size=tp_size)


class Owner:
    """A torch KV owner in its own process (tests.kv_owner_proc)."""

    def __init__(self, standby: Standby, layout: KVCacheLayout, seed: int) -> None:
        self.proc = standby.start([layout.to_json(), str(seed), "torch"])
        self.cache = seeded_cache(layout, seed)
        line = ""
        while not line.startswith("HANDLE "):
            line = self.proc.stdout.readline()
            assert line, "the owner process exited before printing its handle"
        self.handle = KVAgentHandle.from_bytes(bytes.fromhex(line.split()[1]))

    def stop(self) -> None:
        stop_process(self.proc)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def standby():
    pool = Standby(size=2)
    yield pool
    pool.close()


@pytest.fixture
def owners(standby):
    made: list[Owner] = []

    def make(layout: KVCacheLayout, seed: int) -> Owner:
        made.append(Owner(standby, layout, seed))
        return made[-1]

    yield make
    for o in made:
        if o.proc.poll() is None:
            o.resume()
        reap(o.proc)


@pytest.fixture
def agents(kv_agents):
    """In-process torch agents over BASE unless told (tests/conftest.py)."""
    return lambda layout=BASE, seed=None: kv_agents("torch", layout, seed)


def _in_thread(fn, bound_s: float) -> dict:
    """Runs ``fn`` on a thread for at most ``bound_s``: {"error": ..., "seconds": ...}, or
    {"hung": True} when it was still running then (the thread is left to end by itself)."""
    out: dict = {}

    def run() -> None:
        t0 = time.monotonic()
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            out["error"] = e
        out["seconds"] = time.monotonic() - t0

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(bound_s)
    return out if not t.is_alive() else {"hung": True}


def _threads_named(name: str) -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == name}


# --- 1. the first connection to a stalled owner keeps the pull's timeout -----------------------

def test_a_first_pull_from_a_stopped_owner_times_out(owners, agents):
    owner = owners(BASE, 1)
    owner.stop()  # before any pair: the store client's handshake is what waits
    reader = agents()
    out = _in_thread(lambda: reader.pull([owner.handle], [1], [1], timeout_s=1.5),
                     1.5 + MARGIN_S)
    assert not out.get("hung"), "the pull hung on the owner's store handshake"
    assert isinstance(out["error"], TransferTimeout)
    # Nothing was left behind to wait on the stopped owner.
    assert wait_until(lambda: not _threads_named("pdserve-kv-join"), 5.0)
    owner.resume()
    reader.pull([owner.handle], [2], [2], timeout_s=20.0)  # once it runs again, it serves
    assert torch.equal(reader.cache[2], owner.cache[2])


def test_a_first_pull_from_a_store_port_that_never_answers_times_out(agents):
    owner, reader = agents(seed=2), agents()
    silent = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []
    threading.Thread(target=lambda: accepted.append(silent.accept()[0]), daemon=True).start()
    handle = replace(owner.handle(), metadata=json.dumps(
        {"store_port": silent.getsockname()[1]}).encode())
    try:
        out = _in_thread(lambda: reader.pull([handle], [1], [1], timeout_s=1.5),
                         1.5 + MARGIN_S)
        assert not out.get("hung"), "the pull hung on a store port that never answers"
        assert isinstance(out["error"], TransferTimeout)
        assert wait_until(lambda: not _threads_named("pdserve-kv-join"), 5.0)
    finally:
        for s in (silent, *accepted):
            s.close()


def test_a_close_ends_a_connect_the_owners_host_never_answers(agents):
    """A pull's connect to an owner whose host takes no connection (here its listener's queue
    is full, so the SYN goes unanswered) ends at the agent's close, not at the pull's
    deadline: the socket was out of close()'s reach until its connect completed."""
    owner, reader = agents(seed=3), agents()
    full = socket.create_server(("127.0.0.1", 0), backlog=0)
    queued = socket.create_connection(full.getsockname())  # the queue's one place
    handle = replace(owner.handle(), address=f"127.0.0.1:{full.getsockname()[1]}")
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as ex:
            # A deadline past the wait below: only the close ends this pull in time.
            pull = ex.submit(reader.pull, [handle], [1], [1], timeout_s=300.0)
            assert wait_until(lambda: _connecting(reader), 30)
            reader.close()
            with pytest.raises(TransferError, match="was closed during it"):
                pull.result(timeout=120)
    finally:
        queued.close()
        full.close()


_TCP_SYN_SENT = 2


def _connecting(agent) -> bool:
    """Whether one of ``agent``'s handshakes is in its connect (TCP_INFO's state)."""
    with agent._pairs_lock:
        socks = list(agent._handshakes)
    return any(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] == _TCP_SYN_SENT
               for s in socks)


# --- 2. a handle that does not describe the owner's cache --------------------------------------

_STALE_READER = r"""
import json, sys
from dataclasses import replace
import torch
from kvtransfer import KVAgentHandle, PeerGoneError, make_agent
good = KVAgentHandle.from_bytes(bytes.fromhex(sys.argv[1]))
out = {}
for case, block_size in (("owner sends more", 2), ("owner sends fewer", 8)):
    # Same bytes in all, so it passes as a handle; other bytes per block than the owner's.
    lay = replace(good.layout, block_size=block_size,
                  num_blocks=good.layout.num_blocks * good.layout.block_size // block_size)
    stale = replace(good, layout=lay)
    stale.validate()
    reader = make_agent("torch", torch.full(lay.shape, -7.0), lay)
    try:
        reader.pull([stale], [1, 2], [1, 2], timeout_s=10.0)
        out[case] = "pulled"
    except PeerGoneError as e:  # a stale handle: the request moves, as with NIXL
        out[case] = "refused" if "sends" in str(e) else f"other: {e}"
    out[case + ": cache untouched"] = bool((reader.cache == -7.0).all())
    reader.close()
print("RESULT", json.dumps(out), flush=True)
"""


def test_a_reply_of_another_size_is_refused_before_the_receive(agents, monkeypatch):
    # An owner from before the hello check (it would refuse these handles when connecting):
    # only the reader's check of the reply's size stands between the stale handle and gloo,
    # which aborts the reader's process on a longer message and leaves garbage on a shorter.
    monkeypatch.setattr(TorchOwnerServer, "_check_hello_names_this_cache",
                        lambda self, req: None)
    owner = agents(seed=3)
    proc = subprocess.run([sys.executable, "-c", _STALE_READER, owner.handle().to_bytes().hex()],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result == {"owner sends more": "refused", "owner sends more: cache untouched": True,
                      "owner sends fewer": "refused", "owner sends fewer: cache untouched": True}


def test_the_owner_refuses_a_hello_naming_another_agent_or_layout(agents):
    owner, reader = agents(seed=4), agents()
    good = owner.handle()
    # Another agent's handle pointing at this owner's address (it took over the port).
    with pytest.raises(PeerGoneError, match="the owner refused.*not 'someone-else'") as err:
        reader.pull([replace(good, agent_name="someone-else")], [1], [1], timeout_s=10.0)
    # A stale handle's KV is gone, as NIXL finds it: the request is prefilled again elsewhere,
    # not failed as the caller's bad input (INVALID_ARGUMENT, no mark).
    assert status_for(err.value) == grpc.StatusCode.UNAVAILABLE
    assert failure_marks(err.value) == KV_SOURCE_FAILED
    other = replace(BASE, num_blocks=12)  # compatible with the reader, not the owner's
    stale = replace(good, layout=other, num_bytes=other.num_blocks * other.bytes_per_block)
    with pytest.raises(PeerGoneError, match="the owner refused"):
        reader.pull([stale], [1], [1], timeout_s=10.0)
    assert not reader.cache.any()
    reader.pull([good], [1], [1], timeout_s=10.0)  # the true handle still reads
    assert torch.equal(reader.cache[1], owner.cache[1])


# --- 3. pulls queued behind a failed one on the same connection --------------------------------

def test_a_pull_queued_behind_a_failed_one_reconnects(owners, agents):
    owner = owners(BASE, 5)
    reader = agents()
    reader.pull([owner.handle], [1], [1], timeout_s=20.0)  # the pair is up
    owner.stop()
    first: dict = {}

    def failing() -> None:
        try:
            reader.pull([owner.handle], [2], [2], timeout_s=1.0)
        except TransferError as e:
            first["error"] = e

    a = threading.Thread(target=failing)
    a.start()
    time.sleep(0.3)  # the failing pull holds the connection
    queued: dict = {}
    b = threading.Thread(target=lambda: queued.update(_in_thread(
        lambda: reader.pull([owner.handle], [3], [3], timeout_s=30.0), 30.0 + MARGIN_S)))
    b.start()
    time.sleep(0.3)  # the queued one waits for the connection now
    a.join()
    assert isinstance(first["error"], TransferTimeout)
    owner.resume()
    b.join()
    assert "error" not in queued and not queued.get("hung"), queued
    assert torch.equal(reader.cache[3], owner.cache[3])


# --- 4. a pull from several owners keeps one deadline -----------------------------------------

def test_a_pull_from_two_owners_ends_at_its_deadline(owners, agents):
    a, b = owners(rank_layout(0, 2), 6), owners(rank_layout(1, 2), 7)
    reader = agents()
    reader.pull([a.handle, b.handle], [0], [0], timeout_s=20.0)  # the pairs are up
    a.stop()
    b.stop()
    timeout_s = 5.0
    # The first owner answers just before the deadline; the second never does. Each reply
    # read used to get the whole timeout again: 2 * timeout_s - 0.5 in all.
    timer = threading.Timer(timeout_s - 0.5, a.resume)
    timer.start()
    out = _in_thread(lambda: reader.pull([a.handle, b.handle], [1], [1], timeout_s=timeout_s),
                     3 * timeout_s)
    timer.join()
    b.resume()
    assert isinstance(out.get("error"), TransferTimeout), out
    assert out["seconds"] < timeout_s + 3.5  # the deadline, not one timeout per owner


# --- 5. an owner gathers no more than its cache for one request -------------------------------

def test_an_owner_refuses_more_block_ids_than_its_cache_holds(agents):
    owner = agents(seed=8)
    reader = agents(replace(BASE, num_blocks=2 * BASE.num_blocks))
    n = BASE.num_blocks + 1
    with pytest.raises(ValueError, match="more than the 24 blocks of the remote cache"):
        reader.pull([owner.handle()], [0] * n, list(range(n)), timeout_s=10.0)
    # The same request straight on the wire (a reader that skips its own checks).
    pair = reader._pair(owner.handle(), time.monotonic() + 20.0)
    with pair.lock:
        wire.send_frame(pair.sock, {"op": "pull", "tag": 999, "block_ids": [0] * 40_000,
                                    "head_start": 0, "num_heads": 4, "timeout_s": 5.0})
        pair.sock.settimeout(20.0)
        reply = wire.recv_frame(pair.sock)
    assert reply["ok"] is False and "more than the 24 blocks" in reply["error"]
    reader.pull([owner.handle()], [0, 0], [4, 5], timeout_s=10.0)  # the owner serves on
    assert torch.equal(reader.cache[[4, 5]], owner.cache[[0, 0]])


def test_a_frame_nested_too_deep_is_garbage_like_any_other():
    """json's RecursionError got past the ValueError a peer's garbage is (the owner's serve
    thread died with a traceback; a reader's pull failed INTERNAL)."""
    ours, theirs = socket.socketpair()
    try:
        data = b"[" * 100_000
        theirs.sendall(wire._HEADER.pack(len(data)) + data)
        with pytest.raises(ValueError, match="bad control frame"):
            wire.recv_frame(ours, time.monotonic() + 10)
    finally:
        ours.close()
        theirs.close()


# --- 6. a closed owner lets go of its ports and threads ---------------------------------------

def test_a_closed_owner_ends_hellos_that_never_join_and_closes_its_store():
    before = _threads_named("pdserve-kv-serve")
    owner = make_agent("torch", torch.zeros(BASE.shape), BASE)
    handle = owner.handle()
    store_port = json.loads(handle.metadata)["store_port"]
    host, _, port = handle.address.rpartition(":")
    peers = []
    try:
        for i in range(3):  # hellos naming a long wait, whose readers never join
            s = socket.create_connection((host, int(port)))
            wire.send_frame(s, {"op": "hello", "reader": "x", "prefix": f"never/{i}",
                                "timeout_s": 1e6})
            peers.append(s)
        assert wait_until(lambda: owner._server.num_readers == 3, 10.0)
        owner.close()
        # The serve threads were waiting in the join: closing the store ends them.
        assert wait_until(lambda: not _threads_named("pdserve-kv-serve") - before, 10.0)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((host, store_port), timeout=5.0).close()
    finally:
        owner.close()
        for s in peers:
            s.close()


def test_a_hello_that_never_joins_holds_up_no_other_reader(agents):
    owner, reader = agents(seed=9), agents()
    host, _, port = owner.handle().address.rpartition(":")
    with socket.create_connection((host, int(port))) as stuck:
        wire.send_frame(stuck, {"op": "hello", "reader": "x", "prefix": "never/0",
                                "timeout_s": 1e6})
        assert wait_until(lambda: owner._server.num_readers == 1, 10.0)
        # Its join waits on the store for a reader that never comes; this one's must not
        # queue behind that wait.
        reader.pull([owner.handle()], [1], [1], timeout_s=10.0)
    assert torch.equal(reader.cache[1], owner.cache[1])


def test_a_readers_timeout_is_capped_and_checked():
    assert reader_timeout({"timeout_s": 1e6}) == MAX_READER_WAIT_S
    assert reader_timeout({"timeout_s": 10**400}) == MAX_READER_WAIT_S
    assert reader_timeout({"timeout_s": 2.5}) == 2.5
    for bad in (float("nan"), -1, 0, "5", None, True, [1]):
        with pytest.raises(ValueError, match="timeout_s"):
            reader_timeout({"timeout_s": bad})


# --- 7. malformed input is a ValueError -------------------------------------------------------

def test_handle_integers_must_be_integers(agents):
    d = json.loads(agents().handle().to_bytes())
    cases = [{"base_addr": "Infinity"}, {"num_bytes": "Infinity"}, {"device_id": "Infinity"},
             {"base_addr": d["base_addr"] + 0.5}, {"base_addr": str(d["base_addr"])},
             {"device_id": True}, {"num_bytes": float(d["num_bytes"])},
             {"agent_name": 5}, {"address": None}, {"mem_type": ["DRAM"]}]
    for change in cases:
        raw = json.dumps({**d, **change}).replace('"Infinity"', "Infinity").encode()
        with pytest.raises(ValueError, match="a KV agent handle's"):
            KVAgentHandle.from_bytes(raw)


def test_torch_metadata_needs_a_store_port_in_range(agents):
    owner, reader = agents(), agents()
    good = owner.handle()
    for meta in (b'{"store_port": 70000}', b'{"store_port": -1}', b'{"store_port": 0}',
                 b'{"store_port": 1e400}', b'{"store_port": 18446744073709551617}',
                 b'{"store_port": "5000"}', b'{"store_port": true}', b'{}', b'[]', b'nope'):
        bad = replace(good, metadata=meta)
        with pytest.raises(ValueError, match="bad metadata"):
            KVAgentHandle.from_bytes(bad.to_bytes())
        with pytest.raises(ValueError, match="bad metadata"):  # a handle made in code
            reader.pull([bad], [1], [1], timeout_s=5.0)


def test_block_ids_past_int64_and_timeouts_past_a_day_are_value_errors(agents):
    reader = agents()
    h = reader.handle()
    for ids in ([2**63], [2**64 + 1], [-2**63 - 1]):
        with pytest.raises(ValueError, match="remote block ids must be in"):
            reader.pull([h], ids, [0], timeout_s=5.0)
        with pytest.raises(ValueError, match="local block ids must be in"):
            reader.pull([h], [0], ids, timeout_s=5.0)
    for t in (float("inf"), 1e12, float("nan"), True, -1.0, "5"):
        with pytest.raises(ValueError, match="timeout_s must be"):
            reader.pull([h], [1], [2], timeout_s=t)
    assert reader.peer_names() == []  # refused before any connection
