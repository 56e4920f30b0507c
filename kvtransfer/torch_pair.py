"""Two-rank process groups between a reader and an owner, and waiting on their work.

Each (reader agent, owner agent) pair gets its own group, built straight from a PrefixStore
over the owner's TCPStore (not ``init_process_group``), so a process can hold many pair groups
beside its TP group. The owner is rank 0, the reader rank 1. Gloo on CPU, NCCL on CUDA.
"""
from __future__ import annotations

import datetime
import os
import socket
import struct
import threading
import time

import torch
import torch.distributed as dist

from engine.thread_names import named_thread
from kvtransfer.agent import check_deadline
from kvtransfer.errors import PeerGoneError, TransferError, TransferTimeout

OWNER_RANK, READER_RANK = 0, 1
_CUDA_POLL_S = 0.0005
_WAKE_TAG = 0  # no pull's (they count from 1): fail_gloo_waits receives it, and nothing comes
# TCPStore's wire protocol (torch/csrc/distributed/c10d/TCPStoreBackend.hpp): a client's first
# query validates it with this magic number; PING (13) then echoes a 32-bit nonce.
_VALIDATE, _PING, _MAGIC = 0, 13, 0x3C85F7CE
_QUERY = struct.Struct("=BI")  # native order, as the C++ client copies its values


def make_pair_group(store: dist.Store, prefix: str, rank: int, device_type: str,
                    hostname: str, timeout_s: float):
    """This side's member of the pair group; blocks until the other side joins (gloo)."""
    prefixed = dist.PrefixStore(prefix, store)
    timeout = datetime.timedelta(seconds=max(timeout_s, 1.0))
    if device_type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
    return dist.ProcessGroupGloo(prefixed, rank, 2, opts)


def client_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A TCPStore client. Its constructor pings the server with no time limit (a stopped
    owner hung it for as long as it stayed stopped): call it after ``probe_store``, and from a
    thread that may be abandoned (``PairJoin``)."""
    return dist.TCPStore(host, port, None, False,
                         timeout=datetime.timedelta(seconds=max(timeout_s, 1.0)))


def probe_store(host: str, port: int, deadline: float, what: str) -> None:
    """Returns once the TCPStore at ``host:port`` answers a ping; TransferTimeout at
    ``deadline``, PeerGoneError when it refuses or hangs up, TransferError when what answers is
    no TCPStore."""
    nonce = int.from_bytes(os.urandom(4), "little")
    left = check_deadline(deadline, what)
    try:
        with socket.create_connection((host, port), timeout=left) as sock:
            sock.sendall(_QUERY.pack(_VALIDATE, _MAGIC) + _QUERY.pack(_PING, nonce))
            reply = b""
            while len(reply) < 4:
                sock.settimeout(check_deadline(deadline, what))
                chunk = sock.recv(4 - len(reply))
                if not chunk:
                    raise ConnectionResetError("it hung up")
                reply += chunk
    except (socket.timeout, TimeoutError):
        raise TransferTimeout(f"{what} did not complete within its timeout: the owner's "
                              f"store at {host}:{port} does not answer") from None
    except OSError as e:
        raise PeerGoneError(f"{what}: the owner's store at {host}:{port}: {e}") from None
    if struct.unpack("=I", reply)[0] != nonce:
        raise TransferError(f"{what}: {host}:{port} is not a TCPStore")


class PairJoin:
    """Joins a pair group over the owner's store on a helper thread, which the caller waits
    for until its deadline and may then abandon.

    The TCPStore client's constructor pings with no time limit. ``probe_store`` pings first,
    bounded, so that a stopped owner or a silent port fails at the deadline without starting
    anything; the thread bounds what is left, an owner that stops between the probe and the
    client's ping (or within the rendezvous). Such a thread ends when the owner answers or
    its socket fails (it resumes, dies or is killed), and what it built then is dropped.
    Nothing can end it sooner: the client's socket is out of reach in torch. The probe alone
    would leave that window open; the thread alone would leave a thread behind for every
    pull from a stopped owner.
    """

    def __init__(self, host: str, port: int, prefix: str, rank: int, device_type: str,
                 hostname: str, deadline: float, what: str) -> None:
        self._args = (host, port, prefix, rank, device_type, hostname, deadline, what)
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._result: tuple | None = None
        self._error: BaseException | None = None
        self._abandoned = False
        # Readable once the join ended: the caller waits on it beside the control socket.
        self._wake_r, self._wake_w = socket.socketpair()
        named_thread(self._run, "pdserve-kv-join").start()

    def fileno(self) -> int:
        return self._wake_r.fileno()

    def _run(self) -> None:
        host, port, prefix, rank, device_type, hostname, deadline, what = self._args
        try:
            probe_store(host, port, deadline, what)
            store = client_store(host, port, check_deadline(deadline, what))
            pg = make_pair_group(store, prefix, rank, device_type, hostname,
                                 check_deadline(deadline, what))
            result, error = (store, pg), None
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result, error = None, e
        with self._lock:
            if not self._abandoned:
                self._result, self._error = result, error
        self._done.set()
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        self._wake_w.close()

    def result(self, deadline: float, what: str) -> tuple:
        """(store, group), once joined; the join's error, or TransferTimeout at ``deadline``."""
        if not self._done.wait(check_deadline(deadline, what)):
            raise TransferTimeout(f"{what} did not complete within its timeout")
        if self._error is not None:
            raise self._error
        return self._result

    def close(self) -> None:
        """The caller is done (it took the result, or gave up): what the thread builds from
        now on is dropped."""
        with self._lock:
            self._abandoned = True
            self._result = None
        self._wake_r.close()


def wait_work(work, deadline: float, device_type: str, what: str) -> None:
    """Waits for a send/recv until ``deadline``; the backend's failure as a TransferError."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what} did not complete within its timeout")
    try:
        if device_type == "cuda":
            # NCCL's wait() does not block the host: poll, so a dead peer cannot hang us.
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"{what} did not complete within its timeout")
                time.sleep(_CUDA_POLL_S)
            work.wait()
        else:
            work.wait(datetime.timedelta(seconds=left))
    except TransferError:
        raise
    except RuntimeError as e:
        raise classify(e, what) from None


def fail_gloo_waits(pg) -> None:
    """Fails now every wait on the reader's side of gloo pair group ``pg``, and the group with
    them. Nothing wakes a gloo wait, not the group's abort(); but a wait that times out closes
    its context's pairs, failing their other waits ("Application timeout caused pair
    closure"), and a receive of a tag nobody sends times out."""
    try:
        pg.recv([torch.empty(1)], OWNER_RANK, _WAKE_TAG).wait(datetime.timedelta(milliseconds=1))
    except RuntimeError:
        pass  # it timed out, as meant


def classify(e: BaseException, what: str) -> TransferError:
    text = str(e).split("\n")[0]
    if "Timed out" in text or "timeout" in text.lower():
        return TransferTimeout(f"{what} did not complete within its timeout ({text})")
    if "closed" in text.lower() or "reset" in text.lower() or "refused" in text.lower():
        return PeerGoneError(f"{what}: the peer is gone ({text})")
    return TransferError(f"{what} failed: {text}")
