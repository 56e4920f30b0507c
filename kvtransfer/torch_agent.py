"""KV transfer over torch.distributed: gloo on CPU, NCCL on CUDA, one two-rank group per pair.

The owner side (torch_owner) serves pulls from background threads. The reader side here keeps
one connection and one pair group per remote agent, made on first use. A pull sends each
remote rank a request (blocks and head range), receives one contiguous tensor per remote rank
through the pair group and scatters it into the local blocks' head slice. A pair that failed
(timeout, peer gone) is dropped, never reused: its group may be half-way through a message.
"""
from __future__ import annotations

import base64
import contextlib
import json
import os
import selectors
import socket
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer import wire
from kvtransfer.agent import KVTransferAgent, check_deadline
from kvtransfer.errors import PeerGoneError, TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle, torch_store_port
from kvtransfer.plan import PullJob
from kvtransfer.torch_owner import TorchOwnerServer
from kvtransfer.torch_pair import (OWNER_RANK, READER_RANK, PairJoin, classify, fail_gloo_waits,
                                   wait_work)

# Where the owner's control server and store listen (set it to a reachable address across hosts).
HOST_ENV = "PDSERVE_KV_HOST"


@dataclass
class _Pair:
    sock: socket.socket
    pg: object
    store: object
    lock: threading.Lock = field(default_factory=threading.Lock)
    next_tag: int = 1


class TorchKVAgent(KVTransferAgent):
    backend = "torch"

    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, name: str | None = None,
                 host: str | None = None) -> None:
        super().__init__(cache, layout, name)
        self.host = host or os.environ.get(HOST_ENV, "127.0.0.1")
        self._server = TorchOwnerServer(cache, layout, self.host, self.name)
        self._pairs: dict[str, _Pair] = {}
        self._pairs_lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}
        # Sockets of connections being made: close() shuts them, as it does its pairs'. A
        # hello to an owner that never answers (a stopped one) otherwise kept the connecting
        # thread, a release notification's, past close() until its own deadline.
        self._handshakes: set[socket.socket] = set()
        self._closed = False

    def handle(self) -> KVAgentHandle:
        return KVAgentHandle(
            backend="torch", agent_name=self.name,
            metadata=json.dumps({"store_port": self._server.store_port}).encode(),
            base_addr=self.cache.data_ptr(),
            num_bytes=self.cache.numel() * self.cache.element_size(),
            device_id=self.device_id, mem_type=self.mem_type, layout=self.layout,
            address=f"{self.host}:{self._server.port}")

    # --- pairs --------------------------------------------------------------------------------
    def _pair(self, remote: KVAgentHandle, deadline: float) -> _Pair:
        if remote.mem_type != self.mem_type:
            raise ValueError(f"the torch backend moves {self.mem_type} to {self.mem_type}; "
                             f"{remote.agent_name!r} holds {remote.mem_type}")
        with self._pairs_lock:
            if self._closed:
                raise TransferError(f"KV agent {self.name!r} is closed")
            pair = self._pairs.get(remote.agent_name)
            if pair is not None:
                return pair
            connecting = self._connecting.setdefault(remote.agent_name, threading.Lock())
        # One connection per remote even when pulls race to make it.
        _acquire(connecting, deadline, f"connecting to KV owner {remote.agent_name!r}")
        try:
            with self._pairs_lock:
                pair = self._pairs.get(remote.agent_name)
            if pair is None:
                pair = self._connect(remote, deadline)
                with self._pairs_lock:
                    closed = self._closed
                    if not closed:
                        self._pairs[remote.agent_name] = pair
                if closed:
                    # close() took its list of pairs while this one was being made: kept, it
                    # would stay open (and served) on an agent that is gone.
                    _shut(pair.sock)
                    raise TransferError(f"KV agent {self.name!r} is closed")
            return pair
        finally:
            connecting.release()

    def _connect(self, remote: KVAgentHandle, deadline: float) -> _Pair:
        host, _, port = remote.address.rpartition(":")
        what = f"connecting to KV owner {remote.agent_name!r} at {remote.address}"
        store_port = torch_store_port(remote)  # a handle made in code was never validated
        left = check_deadline(deadline, what)
        try:
            sock = self._dial(host, int(port), left)
        except OSError as e:
            if self._closed:  # close() shut the connect down: no peer failed
                raise TransferError(f"{what}: KV agent {self.name!r} was closed during it") \
                    from None
            raise PeerGoneError(f"{what}: {e}") from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prefix = f"kvpair/{self.name}/{uuid.uuid4().hex}"
            # The agent and layout this reader believes it talks to: the owner refuses a
            # handle that describes another cache, before any byte moves.
            wire.send_frame(sock, {"op": "hello", "reader": self.name, "prefix": prefix,
                                   "timeout_s": left, "agent": remote.agent_name,
                                   "layout": json.loads(remote.layout.to_json())})
            store, pg = self._join(sock, host, store_port, prefix, deadline, what)
        except BaseException as e:
            sock.close()
            if self._closed:  # close() shut it: no peer failed
                raise TransferError(f"{what}: KV agent {self.name!r} was closed during it") \
                    from None
            raise _as_transfer_error(e, what) from None
        finally:
            with self._pairs_lock:
                self._handshakes.discard(sock)
        return _Pair(sock, pg, store)

    def _dial(self, host: str, port: int, timeout: float) -> socket.socket:
        """A socket connected to ``host:port``, in ``_handshakes`` from before its connect, so
        that close() shuts a connect still in progress down: to an owner whose host stopped
        answering, it waited out the pull's whole deadline. OSError as socket.create_connection
        raises it; TransferError once closed."""
        error: OSError = OSError(f"no address found for {host!r}")
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, 0,
                                                               socket.SOCK_STREAM):
            sock = socket.socket(family, kind, proto)
            with self._pairs_lock:
                closed = self._closed
                if not closed:
                    self._handshakes.add(sock)
            if closed:
                sock.close()
                raise TransferError(f"KV agent {self.name!r} is closed")
            try:
                sock.settimeout(timeout)
                sock.connect(addr)
                return sock
            except OSError as e:
                with self._pairs_lock:
                    self._handshakes.discard(sock)
                sock.close()
                error = e
        raise error

    def _join(self, sock: socket.socket, host: str, store_port: int, prefix: str,
              deadline: float, what: str) -> tuple:
        """(store, group) of this side of the pair, once the owner said yes. Whichever comes
        first is awaited first: an owner that drops the connection (it is closing, or cannot
        take the hello) never joins, and a failed join never hears from the owner."""
        # This side's address as the owner sees it: the one the group must listen on.
        join = PairJoin(host, store_port, prefix, READER_RANK, self.cache.device.type,
                        sock.getsockname()[0], deadline, what)
        try:
            if sock not in _first_readable((sock, join), check_deadline(deadline, what)):
                join.result(deadline, what)  # its error, if it failed
            _check_hello_reply(sock, deadline, what)
            return join.result(deadline, what)
        finally:
            join.close()

    def _drop(self, remote_name: str, pair: _Pair) -> None:
        with self._pairs_lock:
            if self._pairs.get(remote_name) is pair:
                del self._pairs[remote_name]
        _shut(pair.sock)

    def forget_peer(self, agent_name: str) -> bool:
        with self._pairs_lock:
            connecting = self._connecting.get(agent_name)
            if connecting is not None and connecting.locked():
                return False
            pair = self._pairs.get(agent_name)
            if pair is not None and not pair.lock.acquire(blocking=False):
                return False  # a pull or a notification uses it
            self._connecting.pop(agent_name, None)
            self._pairs.pop(agent_name, None)
        if pair is not None:
            _shut(pair.sock)  # its group and store go with their last reference
            pair.lock.release()
        return True

    def peer_names(self) -> list[str]:
        with self._pairs_lock:
            return sorted(self._pairs)

    # --- pulls --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked_pairs(self, remotes: dict[str, KVAgentHandle], deadline: float, verb: str):
        """The current pair with each remote, locked. A pair dropped while this waited for
        its lock (a pull on it failed, and closed its socket) is replaced, never used: the
        pulls queued behind a failed one failed with it (Bad file descriptor)."""
        while True:
            pairs = {n: self._pair(remotes[n], deadline) for n in sorted(remotes)}
            held = []
            try:
                # In a fixed order, so two pulls over the same remotes cannot deadlock.
                for n, pair in pairs.items():
                    # A pull stuck on this pair (a stalled owner) must not hold this one past
                    # its own deadline.
                    _acquire(pair.lock, deadline, f"{verb} {n!r}")
                    held.append(pair)
                if self._all_current(pairs):
                    yield pairs
                    return
            finally:
                for pair in reversed(held):
                    pair.lock.release()

    def _all_current(self, pairs: dict[str, _Pair]) -> bool:
        with self._pairs_lock:
            return all(self._pairs.get(n) is p for n, p in pairs.items())

    def _run_pull(self, jobs: list[PullJob], deadline: float,
                  notify: bytes | None) -> tuple[int, bool]:
        remotes = {j.remote.agent_name: j.remote for j in jobs}
        with self._locked_pairs(remotes, deadline, "KV pull from") as pairs:
            self._transfer(jobs, pairs, deadline)
        return len(jobs), False

    def _transfer(self, jobs: list[PullJob], pairs: dict[str, _Pair], deadline: float) -> None:
        device_type = self.cache.device.type
        inflight = []
        current = None
        try:
            for job in jobs:  # every request out first, so owners gather in parallel
                current = job.remote.agent_name
                pair = pairs[current]
                tag, pair.next_tag = pair.next_tag, pair.next_tag + 1
                what = f"KV pull from {current!r}"
                pair.sock.settimeout(check_deadline(deadline, what))
                req = {"op": "pull", "tag": tag, "block_ids": job.remote_ids.tolist(),
                       "head_start": job.head_start, "num_heads": job.num_heads}
                # Checked again as it goes: the time may have run out since (a timeout <= 0
                # the owner refused as bad input), and no read may be asked for after it.
                req["timeout_s"] = check_deadline(deadline, what)
                wire.send_frame(pair.sock, req)
                inflight.append((job, pair, tag))
            works = []
            for job, pair, tag in inflight:
                current = job.remote.agent_name
                what = f"KV pull from {current!r}"
                # The time left now: one owner's slow reply must not give the next its own
                # whole timeout (two stalled owners took twice the pull's timeout).
                pair.sock.settimeout(check_deadline(deadline, what))
                reply = _recv_reply(pair.sock, what)
                if not reply.get("ok"):
                    raise ValueError(f"KV owner {current!r} refused the pull: "
                                     f"{reply.get('error')}")
                buf = self._scratch(job)
                _check_size(reply, buf, current)
                works.append((job, buf, pair.pg.recv([buf], OWNER_RANK, tag)))
            for job, buf, work in works:
                current = job.remote.agent_name
                wait_work(work, deadline, device_type, f"KV pull from {current!r}")
                self._scatter(job, buf)
        except BaseException as e:
            for name, pair in pairs.items():
                self._drop(name, pair)
            if isinstance(e, ValueError):
                raise
            if self._closed:  # close() shut the socket under it: no peer failed
                raise TransferError(f"KV pull from {current!r}: KV agent {self.name!r} "
                                    f"was closed during it") from None
            raise _as_transfer_error(e, f"KV pull from {current!r}") from None

    def _scratch(self, job: PullJob) -> torch.Tensor:
        lay = self.layout
        return torch.empty((len(job.local_ids), lay.num_layers, 2, lay.block_size,
                            job.num_heads, lay.head_size), dtype=self.cache.dtype,
                           device=self.cache.device)

    def _scatter(self, job: PullJob, buf: torch.Tensor) -> None:
        index = torch.from_numpy(job.local_ids).to(self.cache.device)
        if job.whole_rows:
            self.cache.index_copy_(0, index, buf)
        else:
            lo = job.head_start - self.layout.kv_head_start
            self.cache[index, ..., lo:lo + job.num_heads, :] = buf

    # --- notifications ------------------------------------------------------------------------
    def _send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        deadline = _now() + 10.0
        name = remote.agent_name
        with self._locked_pairs({name: remote}, deadline, "notifying") as pairs:
            try:
                pairs[name].sock.settimeout(check_deadline(deadline, f"notifying {name!r}"))
                wire.send_frame(pairs[name].sock,
                                {"op": "notify", "msg": base64.b64encode(msg).decode()})
            except OSError as e:
                self._drop(name, pairs[name])
                raise PeerGoneError(f"cannot notify {name!r}: {e}") from None

    def _poll_notifications(self) -> list[bytes]:
        return self._server.take_notifications()

    def close(self) -> None:
        with self._pairs_lock:
            if self._closed:
                return
            self._closed = True
            pairs = list(self._pairs.items())
            handshakes = list(self._handshakes)
        for sock in handshakes:
            # Shut down, not closed: its thread closes it. Closed here, the fd left the
            # thread's epoll set before the thread saw the shutdown's wake-up, and it slept on.
            wire.wake(sock)
        for name, pair in pairs:
            self._drop(name, pair)
            if self.cache.device.type != "cuda":  # NCCL's waits are polled, to their deadline
                # A pull waiting in gloo for its blocks is out of the socket's reach: it waited
                # out its whole timeout.
                fail_gloo_waits(pair.pg)
        self._server.close()


def _now() -> float:
    return time.monotonic()


def _as_transfer_error(e: BaseException, what: str) -> BaseException:
    if isinstance(e, (TransferError, ValueError)):
        return e
    if isinstance(e, (socket.timeout, TimeoutError)):
        return TransferTimeout(f"{what} did not complete within its timeout")
    if isinstance(e, (EOFError, ConnectionError, OSError)):
        return PeerGoneError(f"{what}: the peer is gone ({e})")
    if isinstance(e, RuntimeError):
        return classify(e, what)
    return e


def _shut(sock: socket.socket) -> None:
    """Closes ``sock``, waking a pull blocked in recv() on it: close() alone does not on Linux,
    so close() of the agent left an in-flight pull waiting until its own deadline."""
    wire.wake(sock)
    sock.close()


def _recv_reply(sock: socket.socket, what: str) -> dict:
    """The owner's next control frame. A malformed one is the owner's failure (TransferError),
    not the caller's bad input: as the ValueError it is in wire, the caller was blamed
    (INVALID_ARGUMENT) for a broken peer."""
    try:
        return wire.recv_frame(sock)
    except ValueError as e:
        raise TransferError(f"{what}: the KV owner sent a malformed control frame ({e})") \
            from None


def _first_readable(objs: tuple, timeout_s: float) -> list:
    """Those of ``objs`` (sockets, or objects with a fileno) readable first, within
    ``timeout_s``. epoll, not select(): a busy server's descriptors pass 1024."""
    with selectors.DefaultSelector() as sel:
        for obj in objs:
            sel.register(obj, selectors.EVENT_READ)
        return [key.fileobj for key, _ in sel.select(timeout_s)]


def _check_hello_reply(sock: socket.socket, deadline: float, what: str) -> None:
    """An owner refusing the handle ("layout": another agent or cache listens at its address
    now, its owner restarted) makes it a stale handle, whose KV is gone: PeerGoneError, as
    NIXL's, so the request is prefilled again elsewhere (a ValueError failed it as bad input)."""
    sock.settimeout(check_deadline(deadline, what))
    reply = _recv_reply(sock, what)
    if not reply.get("ok"):
        error = PeerGoneError if reply.get("kind") == "layout" else TransferError
        raise error(f"{what}: the owner refused: {reply.get('error')}")


def _check_size(reply: dict, buf: torch.Tensor, remote_name: str) -> None:
    """Refuses, before the receive is posted, a message of another size than ``buf``: gloo
    aborts the whole process (std::terminate) on a longer one, and a shorter one left the
    tail of ``buf`` uninitialised, scattered into the cache as if it were KV. A handle whose
    layout is not the owner's (a stale one) makes them: PeerGoneError, as for the owner's own
    refusal of one in the hello."""
    want, got = buf.numel() * buf.element_size(), reply.get("nbytes")
    if isinstance(got, bool) or not isinstance(got, int) or got != want:
        raise PeerGoneError(
            f"KV owner {remote_name!r} sends {got!r} bytes for this pull where its handle's "
            f"layout makes {want}: the handle does not describe the owner's cache")


def _acquire(lock: threading.Lock, deadline: float, what: str) -> None:
    """``lock``, waited for until ``deadline`` at most (TransferTimeout after)."""
    if not lock.acquire(timeout=check_deadline(deadline, what)):
        raise TransferTimeout(f"{what} did not complete within its timeout: another transfer "
                              f"on the same connection held it")
