"""The torch KV backend when its own agent closes mid-transfer, and against owners that send
garbage or readers that flood: a closed agent keeps no connection and ends its pulls at once,
a broken owner is the owner's failure (TransferError, never the caller's ValueError), and an
owner bounds its connections, their silence and its notification queue, and lets go of
readers that died or vanished. Real sockets, real gloo groups and TCPStores, in-process agents
(and a reader process to kill)."""
from __future__ import annotations

import array
import functools
import fcntl
import logging
import os
import socket
import struct
import subprocess
import sys
import termios
import threading
import time
import traceback
from dataclasses import replace

import pytest
import torch

from kvtransfer import TransferError, TransferTimeout, torch_owner, torch_pair, wire
from tests.kv_owner_proc import SMALL_LAYOUT
from tests.proc_signals import reap, wait_until

LAYOUT = SMALL_LAYOUT
_TCP_REPAIR = 19  # linux/tcp.h; the socket module does not name it
# 64 KiB blocks: a pull of all of them (8 MiB) is more than loopback's socket buffers hold, so
# the owner's send waits for a reader that stopped before receiving it.
BIG = replace(LAYOUT, num_layers=4, num_blocks=128, block_size=16, head_size=64)
# Far beyond what any of these steps takes, however loaded the machine: reaching it is a hang.
BOUND_S = 30.0


@pytest.fixture
def agents(kv_agents):
    """make(seed=None, layout=LAYOUT): an in-process torch agent (tests/conftest.py)."""
    return functools.partial(kv_agents, "torch")


def _started(fn) -> tuple[threading.Thread, dict]:
    """``fn`` running on a thread, and where its error goes ({"error": ...})."""
    out: dict = {}

    def run() -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - checked by the caller
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _joined(t: threading.Thread, out: dict) -> dict:
    """``out`` once ``t`` ended; {"hung": True} when it still runs after BOUND_S."""
    t.join(BOUND_S)
    return out if not t.is_alive() else {"hung": True}


def _waiting_in_recv(t: threading.Thread) -> bool:
    """Whether ``t`` is blocked in a control socket's recv now: its frame is wire's, and the
    kernel has it asleep in poll (CPython's wait on a socket with a timeout), not on the GIL.
    Before it got there, a close() made its recv fail at once, fixed or not."""
    frame = sys._current_frames().get(t.ident)
    if frame is None or frame.f_code.co_name != "_recv_exact":
        return False
    with open(f"/proc/self/task/{t.native_id}/wchan") as f:
        return "poll" in f.read()


def _raw_connection(owner) -> socket.socket:
    host, _, port = owner.handle().address.rpartition(":")
    return socket.create_connection((host, int(port)), timeout=BOUND_S)


def _read_until_closed(sock: socket.socket) -> None:
    """Returns once the owner ended ``sock`` (EOF or reset), past any refusal it sent first;
    TimeoutError (BOUND_S) when the owner keeps it open."""
    try:
        while sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


# --- a closed reader agent ---------------------------------------------------------------------

def test_a_pair_made_while_the_agent_closes_is_not_kept(agents):
    owner, reader = agents(seed=1), agents()
    connected, go = threading.Event(), threading.Event()
    connect = reader._connect

    def slow_connect(remote, deadline):
        pair = connect(remote, deadline)  # the real connection and pair group
        connected.set()
        go.wait(BOUND_S)  # close() runs while the connection is being made
        return pair

    reader._connect = slow_connect
    pull = _started(lambda: reader.pull([owner.handle()], [1, 2], [3, 4], timeout_s=BOUND_S))
    assert connected.wait(BOUND_S)
    reader.close()
    go.set()
    out = _joined(*pull)
    assert isinstance(out.get("error"), TransferError), out
    assert f"KV agent {reader.name!r} is closed" in str(out["error"])
    assert reader.peer_names() == []
    # The owner saw the connection end: it serves nothing for the closed agent.
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)
    assert not reader.cache[3:5].any()


def test_close_ends_a_notification_whose_owner_never_answers_the_hello(agents):
    """A failed pull's release goes out on a background thread (engine/kv_release_sender),
    which then connects afresh: to an owner that accepts and never answers (a stopped one)
    it waited out the notification's 10 s, past the agent's close()."""
    reader = agents()
    listener = socket.create_server(("127.0.0.1", 0))  # it reads, and never answers
    listener.settimeout(BOUND_S)
    port = listener.getsockname()[1]
    silent = replace(agents().handle(), agent_name="silent", address=f"127.0.0.1:{port}",
                     metadata=f'{{"store_port": {port}}}'.encode())
    conns = []
    try:
        notify = _started(lambda: reader.send_notification(silent, b"release:x"))
        while True:  # until one of its connections speaks: the hello goes out first
            conns.append(listener.accept()[0])
            conns[-1].settimeout(0.2)
            try:
                if conns[-1].recv(1):
                    break
            except socket.timeout:
                pass
        reader.close()
        out = _joined(*notify)
        assert isinstance(out.get("error"), TransferError), out
        assert "was closed during it" in str(out["error"])
    finally:
        for c in conns:
            c.close()
        listener.close()


def test_close_ends_a_pull_waiting_on_a_stalled_owner(agents):
    owner, reader = agents(seed=1), agents()
    reader.pull([owner.handle()], [0], [0], timeout_s=BOUND_S)  # the pair exists
    gathering, stall = threading.Event(), threading.Event()

    def stalled_gather(req):
        gathering.set()
        stall.wait(4 * BOUND_S)
        # A refusal, not blocks: nothing is left sending to the closed reader's group.
        raise ValueError("the test is over")

    owner._server._gather = stalled_gather
    try:  # waiting for the owner's reply
        _close_mid_pull(owner, reader, gathering, _waiting_in_recv)
    finally:
        stall.set()


def _close_mid_pull(owner, reader, reached: threading.Event, waiting) -> None:
    """Pulls block 1 and closes ``reader`` once ``reached`` is set and ``waiting(thread)``
    says where the pull waits: it ends by the close, not by its own timeout (past BOUND_S),
    and says so."""
    pull = _started(lambda: reader.pull([owner.handle()], [1], [1], timeout_s=4 * BOUND_S))
    assert reached.wait(BOUND_S)
    assert wait_until(lambda: waiting(pull[0]), BOUND_S)
    reader.close()
    done = _joined(*pull)
    assert "hung" not in done
    # This agent closed: no peer is to blame (not a PeerGoneError, "the peer is gone").
    assert type(done.get("error")) is TransferError, done
    assert f"KV agent {reader.name!r} was closed" in str(done["error"])


def _stall_before_sending(owner) -> tuple[threading.Event, threading.Event]:
    """(replied, stall): the owner answers a pull's request, then posts its send only once
    ``stall`` is set, as a stopped or busy owner would."""
    server = owner._server
    replied, stall = threading.Event(), threading.Event()

    def stalled_pull(conn, pg, req):
        data = server._gather(req)
        wire.send_frame(conn, {"ok": True, "nbytes": data.numel() * data.element_size()})
        replied.set()
        stall.wait(4 * BOUND_S)
        torch_pair.wait_work(pg.send([data], torch_pair.READER_RANK, req["tag"]),
                             time.monotonic() + BOUND_S, "cpu", "sending KV blocks")

    server._pull = stalled_pull
    return replied, stall


def _in_frame(t: threading.Thread, name: str) -> bool:
    frame = sys._current_frames().get(t.ident)
    return frame is not None and name in {f.name for f in traceback.extract_stack(frame)}


def test_close_ends_a_pull_waiting_in_the_groups_recv(agents):
    """gloo's wait cannot be woken (not by the group's abort() either): close() left such a
    pull waiting out its whole timeout."""
    owner, reader = agents(seed=1), agents()
    reader.pull([owner.handle()], [0], [0], timeout_s=BOUND_S)  # the pair exists
    replied, stall = _stall_before_sending(owner)
    try:
        _close_mid_pull(owner, reader, replied, lambda t: _in_frame(t, "wait_work"))
    finally:
        stall.set()
    # close() closed the group: the owner's late send fails rather than waiting for a reader
    # that is gone, and nothing lands in the cache.
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)
    assert not reader.cache[1].any()


# --- an owner that sends garbage -----------------------------------------------------------------

def _send_garbage(conn: socket.socket) -> None:
    conn.sendall(struct.pack("!I", 5) + b"{oops")


def test_a_malformed_pull_reply_is_the_owners_failure(agents):
    owner, reader = agents(seed=1), agents()
    reader.pull([owner.handle()], [0], [0], timeout_s=BOUND_S)
    owner._server._pull = lambda conn, pg, req: _send_garbage(conn)
    with pytest.raises(TransferError, match="malformed control frame") as e:
        reader.pull([owner.handle()], [1], [1], timeout_s=BOUND_S)
    assert not isinstance(e.value, ValueError)  # ValueError blamed the caller
    assert reader.peer_names() == []  # the connection is out of step: dropped


def test_a_malformed_hello_reply_is_the_owners_failure(agents):
    owner, reader = agents(seed=1), agents()
    owner._server._hello = lambda conn, req: _send_garbage(conn)
    with pytest.raises(TransferError, match="malformed control frame") as e:
        reader.pull([owner.handle()], [1], [1], timeout_s=5.0)
    assert not isinstance(e.value, ValueError)


class _StallingSocket:
    """A pair's socket whose first settimeout() sleeps past the timeout it is given: a pull
    thread descheduled between the check of its deadline and its request. Records what the
    reader sends."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self.sent: list[bytes] = []
        self._stalled = False

    def settimeout(self, t: float | None) -> None:
        if not self._stalled and t is not None:
            self._stalled = True
            time.sleep(t + 0.05)
        self._sock.settimeout(t)

    def sendall(self, data: bytes) -> None:
        self.sent.append(data)
        self._sock.sendall(data)

    def __getattr__(self, name):
        return getattr(self._sock, name)


def test_no_pull_request_goes_out_after_its_deadline(agents):
    owner, reader = agents(seed=1), agents()
    reader.pull([owner.handle()], [0], [0], timeout_s=BOUND_S)
    (pair,) = reader._pairs.values()
    stalling = pair.sock = _StallingSocket(pair.sock)
    with pytest.raises(TransferTimeout):
        reader.pull([owner.handle()], [1], [1], timeout_s=0.5)
    # Sent, its timeout_s was <= 0: the owner refused it as bad input.
    assert stalling.sent == []


# --- an owner's bounds on its readers ------------------------------------------------------------

def test_an_owner_refuses_connections_past_its_cap(agents, monkeypatch, caplog):
    monkeypatch.setattr(torch_owner, "MAX_CONNECTIONS", 2)
    owner = agents(seed=1)
    held = [_raw_connection(owner) for _ in range(2)]
    try:
        assert wait_until(lambda: owner._server.num_readers == 2, BOUND_S)
        with caplog.at_level(logging.WARNING, logger=torch_owner.__name__):
            for _ in range(3):
                with _raw_connection(owner) as extra:
                    _read_until_closed(extra)
        assert owner._server.num_readers == 2
        refusals = [r for r in caplog.records if "refusing more" in r.getMessage()]
        assert len(refusals) == 1  # once for the run of refusals, not once each
    finally:
        for s in held:
            s.close()
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)
    reader = agents()
    reader.pull([owner.handle()], [1], [1], timeout_s=BOUND_S)  # served again
    assert torch.equal(reader.cache[1], owner.cache[1])


# A reader that stops itself (SIGSTOP) once the owner has answered its pull, before it posts
# the receive: the owner is then sending, and nobody receives.
_READER_STOPPED_MID_PULL = r"""
import os, signal, sys
import torch
from kvtransfer import KVAgentHandle, make_agent, torch_agent
handle = KVAgentHandle.from_bytes(bytes.fromhex(sys.argv[1]))
check = torch_agent._check_size

def stop_once_answered(reply, buf, remote_name):
    check(reply, buf, remote_name)
    os.kill(os.getpid(), signal.SIGSTOP)

torch_agent._check_size = stop_once_answered
reader = make_agent("torch", torch.zeros(handle.layout.shape), handle.layout)
ids = list(range(handle.layout.num_blocks))
reader.pull([handle], ids, ids, timeout_s=600.0)
"""


def _serve_thread_sending(owner) -> bool:
    """Whether one of the owner's connection threads waits for its pull's send now."""
    names = {t.ident for t in threading.enumerate() if t.name == "pdserve-kv-serve"}
    for ident, frame in sys._current_frames().items():
        while ident in names and frame is not None:
            if frame.f_code.co_name == "wait_work":
                return True
            frame = frame.f_back
    return False


def test_an_owner_lets_go_of_a_reader_killed_mid_pull(agents):
    owner = agents(seed=1, layout=BIG)
    proc = subprocess.Popen([sys.executable, "-c", _READER_STOPPED_MID_PULL,
                             owner.handle().to_bytes().hex()])
    try:
        stopped = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
        assert stopped.si_code == os.CLD_STOPPED, stopped
        assert wait_until(lambda: _serve_thread_sending(owner), BOUND_S)
        proc.kill()
    finally:
        reap(proc)
    # Its send fails, and the connection, its thread and its pair group go with it.
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)
    assert not _serve_thread_sending(owner)
    reader = agents(layout=BIG)
    reader.pull([owner.handle()], [5, 9], [1, 2], timeout_s=BOUND_S)  # served as before
    assert torch.equal(reader.cache[[1, 2]], owner.cache[[5, 9]])


def test_an_owner_forgets_each_pairs_store_keys_once_its_connection_ends(agents):
    # A reader makes a new pair after every failed pull and every start: each pair's join
    # stayed in the owner's store for good.
    owner = agents(seed=1)
    store = owner._server._store
    for _ in range(2):
        reader = agents()
        reader.pull([owner.handle()], [1], [1], timeout_s=BOUND_S)
        assert store.num_keys() > 0  # the pair's, while its connection lasts
        reader.close()
    # A join that never completes leaves the owner's half.
    with _raw_connection(owner) as s:
        wire.send_frame(s, {"op": "hello", "reader": "r", "prefix": "kvpair/r/never",
                            "timeout_s": 0.5})
        _read_until_closed(s)
    assert wait_until(lambda: owner._server.num_readers == 0 and store.num_keys() == 0,
                      BOUND_S), store.num_keys()
    reader = agents()
    reader.pull([owner.handle()], [2], [2], timeout_s=BOUND_S)  # later pairs join as before
    assert torch.equal(reader.cache[2], owner.cache[2])


def _unsent_bytes(sock: socket.socket) -> int:
    """Bytes ``sock`` sent that its peer has not acknowledged yet (or not sent yet)."""
    buf = array.array("i", [0])
    fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, buf)
    return buf[0]


def _vanish(sock: socket.socket) -> None:
    """Closes ``sock`` without a FIN or an RST, as a host that crashed or was cut off leaves
    its connections: in TCP repair mode, close() only forgets the socket (CAP_NET_ADMIN)."""
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _TCP_REPAIR, 1)
    except PermissionError:
        pytest.skip("TCP repair mode needs CAP_NET_ADMIN")
    sock.close()


def test_an_owner_lets_go_of_a_reader_whose_host_vanished(agents, monkeypatch):
    # An idle connection waits for the reader's next pull with no time limit: without
    # keepalive probes one whose reader vanished held its thread and a connection for good.
    monkeypatch.setattr(torch_owner, "KEEPALIVE_IDLE_S", 1)
    monkeypatch.setattr(torch_owner, "KEEPALIVE_INTERVAL_S", 1)
    owner, reader = agents(seed=1), agents()
    reader.pull([owner.handle()], [1], [1], timeout_s=BOUND_S)
    (conn,) = owner._server._conns
    # The owner's reply acknowledged: else its retransmission, not a probe, finds the reader
    # gone (this host's kernel answers it with an RST).
    assert wait_until(lambda: _unsent_bytes(conn) == 0, BOUND_S)
    (pair,) = reader._pairs.values()
    _vanish(pair.sock)
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)
    other = agents()
    other.pull([owner.handle()], [2], [2], timeout_s=BOUND_S)  # others are served as before
    assert torch.equal(other.cache[2], owner.cache[2])


def test_an_owner_drops_a_connection_that_says_no_hello(agents, monkeypatch):
    monkeypatch.setattr(torch_owner, "HELLO_TIMEOUT_S", 0.5)
    owner = agents(seed=1)
    with _raw_connection(owner) as silent, _raw_connection(owner) as halfway:
        halfway.sendall(struct.pack("!I", 100)[:2])  # half a header, then nothing
        _read_until_closed(silent)
        _read_until_closed(halfway)
    assert wait_until(lambda: owner._server.num_readers == 0, BOUND_S)


def test_an_owner_drops_a_hello_that_trickles_in(agents, monkeypatch):
    monkeypatch.setattr(torch_owner, "HELLO_TIMEOUT_S", 0.5)
    owner = agents(seed=1)
    with _raw_connection(owner) as s:
        s.sendall(struct.pack("!I", 10_000))
        assert wait_until(lambda: owner._server.num_readers == 1, BOUND_S)
        # A byte every 0.1 s keeps each recv under the hello timeout, never the frame.
        for _ in range(int(BOUND_S / 0.1)):
            if owner._server.num_readers == 0:
                break
            try:
                s.sendall(b" ")
            except OSError:  # reset by the owner
                break
            time.sleep(0.1)
        assert owner._server.num_readers == 0


def test_an_owner_takes_notifications_only_after_a_hello(agents):
    owner = agents(seed=1)
    with _raw_connection(owner) as s:
        wire.send_frame(s, {"op": "notify", "msg": "cmVsZWFzZTp4"})  # b"release:x"
        _read_until_closed(s)
    assert owner.poll_notifications() == []


def test_an_owner_refuses_notifications_past_its_queue(agents, monkeypatch):
    owner, reader = agents(seed=1), agents()
    monkeypatch.setattr(torch_owner, "MAX_QUEUED_NOTIFICATIONS", 3)
    for i in range(5):
        reader.send_notification(owner.handle(), b"release:%d" % i)
    # Served in order on the one connection: once this pull is answered, all five arrived.
    reader.pull([owner.handle()], [1], [1], timeout_s=BOUND_S)
    # The first ones are kept: a refused release only leaves its lease to expire.
    assert owner.poll_notifications() == [b"release:0", b"release:1", b"release:2"]
    monkeypatch.setattr(torch_owner, "MAX_QUEUED_NOTIFICATION_BYTES", 10)
    for msg in (b"a" * 6, b"b" * 4, b"c"):
        reader.send_notification(owner.handle(), msg)
    reader.pull([owner.handle()], [2], [2], timeout_s=BOUND_S)
    assert owner.poll_notifications() == [b"a" * 6, b"b" * 4]
    reader.send_notification(owner.handle(), b"again")  # room again once polled
    reader.pull([owner.handle()], [3], [3], timeout_s=BOUND_S)
    assert owner.poll_notifications() == [b"again"]
