"""One NIXL agent as a reader: its cache registration, its connections, and batched READs
with completion polling, a deadline and release.

NIXL's agent in its default sync mode (and UCX's worker under it) must not be entered by two
threads at once, so every call into it goes through ``lock``. A ``NixlStream`` is a second
reader with its own agent and thread: UCX's CMA copy runs inside the posting call, on the
posting thread, so two agents posting halves of a pull from two threads copy in parallel.
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from kvtransfer.errors import PeerGoneError, TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle

logger = logging.getLogger(__name__)
# Completion polling interval: short, since a READ of a few MB finishes in about a millisecond.
_POLL_S = 0.0002
# How long past the pull's deadline a stream's thread may take to hand back its result: it
# honours the deadline itself, so only a call stuck inside NIXL gets this far.
_STREAM_GRACE_S = 5.0
# How long a failed pull waits for its READs still in flight to end before it reports that
# they may land later (and the engine quarantines their blocks for kv_quarantine_s): a
# deadline that ran out mid-pull left 5 blocks quarantined for a minute, though the owner
# served the READ a few milliseconds later. A stopped or unreachable owner outlasts it.
_SETTLE_S = 0.5
# How long close() waits for the reads in flight to end (they notice the close at their next
# poll, then settle for at most _SETTLE_S) before it deregisters the cache under them.
_CLOSE_WAIT_S = 5.0


def _keep_forever(agent) -> None:
    """Never destroys ``agent``: a READ that failed (its owner died, or its deadline ran out)
    can leave its request queued inside UCX for good, and destroying the worker then aborts the
    process (UCX's assertion ``ucs_arbiter_group_is_empty``, signal 6) or leaks the request:
    seen in about 1 of 25 closes of a reader that pulled from a killed owner, at whatever
    garbage collection or interpreter exit dropped the agent. Progressing the worker before the
    close did not end the request. The reference taken here is never given back, not even by
    the interpreter's teardown, which clears module globals; the memory is a UCX context, a
    few MB, once per reader that saw a failed read."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))


def _region(h: KVAgentHandle) -> tuple:
    return h.base_addr, h.num_bytes, h.device_id, h.mem_type


@dataclass
class _Peer:
    """A remote agent this reader loaded: the name NIXL knows it by and what describes it.

    Reads go by a handle's addresses, and a cache shifted inside its registration reads wrong
    bytes with no error, so every later handle must describe the same cache. Which handle to
    believe: the registry's (``trusted``, from the owner itself), else the first one a read
    succeeded with. A handle no read confirmed yet (one that only failed) is replaced by the
    next, so a corrupted handle met first cannot lock out the owner's genuine ones."""

    nixl_name: str
    metadata: bytes
    region: tuple
    confirmed: bool
    reads_in_flight: int = 0


@dataclass(frozen=True)
class ReadPart:
    """Runs of one remote rank's cache (``rdesc``) into runs of ours (``ldesc``), pairwise."""

    remote: KVAgentHandle
    rdesc: np.ndarray
    ldesc: np.ndarray


class NixlReader:
    def __init__(self, name: str, cache: torch.Tensor, prog_thread: bool = False) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.name = name
        self.mem_type = "VRAM" if cache.is_cuda else "DRAM"
        self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=prog_thread,
                                                        backends=["UCX"]))  # None once closed
        self._reg = self.agent.register_memory(cache)
        self.lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}  # by agent name
        self._closing = False  # set by close(): reads in flight end, new ones are refused
        # Set when a posted READ failed: its request may stay in UCX, so close() must not
        # destroy the agent (_keep_forever).
        self.read_failed = False

    def connect(self, remote: KVAgentHandle, trusted: bool = False) -> str:
        """NIXL's name for ``remote``, loading its metadata on first use (``lock`` held).
        ``trusted``: the handle comes from the owner itself (the registry), and overrides
        what an unconfirmed or differing handle recorded."""
        peer = self._peers.get(remote.agent_name)
        if peer is not None and (peer.metadata, peer.region) == (remote.metadata, _region(remote)):
            peer.confirmed = peer.confirmed or trusted
            return peer.nixl_name
        if peer is not None and peer.confirmed and not trusted:
            raise ValueError(f"handle of {remote.agent_name!r} describes a cache other than "
                             f"the one it registered: {_region(remote)} against {peer.region}")
        if peer is not None and peer.metadata == remote.metadata:
            peer.region, peer.confirmed = _region(remote), trusted
            return peer.nixl_name
        if peer is not None:  # metadata an unconfirmed handle loaded: replaced
            if peer.reads_in_flight:
                raise ValueError(f"handle of {remote.agent_name!r} differs from the one a read "
                                 "in flight uses")
            self._unload(remote.agent_name)
        return self._load(remote, trusted).nixl_name

    def _load(self, remote: KVAgentHandle, trusted: bool) -> _Peer:
        known = self.agent.add_remote_agent(remote.metadata)
        if isinstance(known, bytes):
            known = known.decode()
        if known != remote.agent_name:
            # Metadata of another agent under this name: reads would go to that agent.
            if known not in {p.nixl_name for p in self._peers.values()}:
                self.agent.remove_remote_agent(known)
            raise ValueError(f"handle of {remote.agent_name!r} carries the metadata of "
                             f"agent {known!r}")
        peer = _Peer(known, remote.metadata, _region(remote), trusted)
        self._peers[remote.agent_name] = peer
        return peer

    def _unload(self, agent_name: str) -> None:
        peer = self._peers.pop(agent_name)
        try:
            self.agent.remove_remote_agent(peer.nixl_name)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            logger.warning("could not unload NIXL agent %r: %s", agent_name, e)

    def forget(self, agent_name: str) -> bool:
        """Unloads ``agent_name`` (a peer gone for good) and closes its connection; whether
        it is gone now (False: a read from it is in flight, try again later)."""
        with self.lock:
            peer = self._peers.get(agent_name)
            if self.agent is None or peer is None:
                return True
            if peer.reads_in_flight:
                return False
            self._unload(agent_name)
            return True

    def peer_names(self) -> list[str]:
        with self.lock:
            return sorted(self._peers)

    def read(self, parts: list[ReadPart], deadline: float, notify: bytes = b"") -> None:
        """Posts one READ per part, waits for all until ``deadline`` and releases them.
        ``notify`` rides on the READ, so it reaches the owner once the data landed; it needs a
        single part, since a notification on one READ says nothing about another."""
        if notify and len(parts) != 1:
            raise ValueError(f"a notification rides on a single READ, got {len(parts)} parts")
        handles: list = []
        peers: list[_Peer] = []  # whose reads are in flight: forget() leaves them loaded
        try:
            with self.lock:
                self._check_open()
                # A share queued behind another pull's (a stream) or a read waiting for this
                # lock may start late: past its deadline the owner's lease may be over.
                if time.monotonic() >= deadline:
                    raise TransferTimeout("a KV read started after its deadline; nothing "
                                          "was posted")
                for p in parts:
                    h = self._prepare(p, notify)
                    handles.append(h)  # before it is posted: a failed post may have begun
                    peers.append(self._peers[p.remote.agent_name])
                    peers[-1].reads_in_flight += 1
                    self._post(h, p.remote.agent_name)
            self._wait(handles, deadline, [p.remote.agent_name for p in parts])
            self._confirm(parts)
        except TransferError as e:
            # Releasing a running READ asks UCX to cancel it, but nothing confirms the cancel:
            # a late completion could still write into blocks the caller is about to reuse.
            # A READ from a live owner cut by the request's deadline lands within milliseconds,
            # so it gets a moment to end before its blocks are given up to the quarantine.
            e.writes_may_land = e.writes_may_land or not self._settle(handles, _SETTLE_S)
            if handles:
                self.read_failed = True
            raise
        finally:
            self._release(handles, peers)

    def _confirm(self, parts: list[ReadPart]) -> None:
        """A read with these handles succeeded: they describe their owners' caches."""
        with self.lock:
            for p in parts:
                peer = self._peers.get(p.remote.agent_name)
                if peer is not None and peer.region == _region(p.remote):
                    peer.confirmed = True

    def _check_open(self) -> None:
        if self.agent is None or self._closing:
            raise TransferError(f"NIXL agent {self.name!r} is closed")

    def _prepare(self, part: ReadPart, msg: bytes):
        """The READ's transfer handle, not yet posted (``lock`` held)."""
        remote = part.remote
        try:
            name = self.connect(remote)
            return self.agent.initialize_xfer(
                "READ", self.agent.get_xfer_descs(part.ldesc, self.mem_type),
                self.agent.get_xfer_descs(part.rdesc, remote.mem_type), name, msg)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise PeerGoneError(f"cannot read from NIXL agent {remote.agent_name!r}: {e}") from None

    def _post(self, h, agent_name: str) -> None:
        """Posts the READ of handle ``h``, which the caller already tracks: a post that failed
        may have gone out in part, so its handle is settled and released with the rest."""
        try:
            state = self.agent.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise PeerGoneError(f"cannot read from NIXL agent {agent_name!r}: {e}") from None
        if state == "ERR":
            raise PeerGoneError(f"NIXL refused the read from {agent_name!r}")

    def _wait(self, handles: list, deadline: float, names: list[str]) -> None:
        pending = list(zip(handles, names))
        while pending:
            try:
                with self.lock:
                    self._check_open()  # a close ends the wait: the cache is going away
                    states = [self.agent.check_xfer_state(h) for h, _ in pending]
            except TransferError:
                raise
            except Exception as e:  # noqa: BLE001
                raise PeerGoneError(f"a NIXL read from {names} failed: {e}") from None
            for (_, name), s in zip(pending, states):
                if s == "ERR":
                    raise PeerGoneError(f"the NIXL read from {name!r} failed (is its owner "
                                        "still alive?)")
            pending = [p for p, s in zip(pending, states) if s != "DONE"]
            if pending:
                if time.monotonic() > deadline:
                    raise TransferTimeout(f"KV pull from {[n for _, n in pending]} did not "
                                          "complete within its timeout")
                time.sleep(_POLL_S)

    def _settle(self, handles: list, within_s: float) -> bool:
        """Whether every READ ended (done or failed) within ``within_s``."""
        end = time.monotonic() + within_s
        while self._any_in_flight(handles):
            if time.monotonic() >= end:
                return False
            time.sleep(_POLL_S)
        return True

    def _any_in_flight(self, handles: list) -> bool:
        if not handles:  # nothing was posted (a read refused at its start, or after a close)
            return False
        with self.lock:
            if self.agent is None:  # closed after _CLOSE_WAIT_S: nothing tells any more
                return True
            for h in handles:
                try:
                    if self.agent.check_xfer_state(h) not in ("DONE", "ERR"):
                        return True
                except Exception:  # noqa: BLE001 - unknown state: assume the worst
                    return True
        return False

    def _release(self, handles: list, peers: list[_Peer]) -> None:
        # Releasing a handle whose READ is still running asks NIXL to abort it.
        with self.lock:
            for peer in peers:
                peer.reads_in_flight -= 1
            if self.agent is None:
                return
            for h in handles:
                try:
                    self.agent.release_xfer_handle(h)
                except Exception as e:  # noqa: BLE001 - a stuck handle must not mask the error
                    logger.warning("could not release a NIXL transfer handle: %s", e)

    def close(self) -> None:
        """Ends the reads in flight (each fails TransferError at its next poll, once it has
        released its handles), then deregisters the cache: deregistered under a running READ,
        its bytes could land in memory the engine has freed, and the read's next poll would
        find no agent."""
        with self.lock:
            if self.agent is None or self._closing:
                return
            self._closing = True
        end = time.monotonic() + _CLOSE_WAIT_S
        while self._reads_in_flight() and time.monotonic() < end:
            time.sleep(_POLL_S)
        with self.lock:
            if any(p.reads_in_flight for p in self._peers.values()):
                logger.warning("NIXL agent %r closes with reads still in flight after %.0f s",
                               self.name, _CLOSE_WAIT_S)
                self.read_failed = True  # as good as failed: they are given up
            for peer in self._peers.values():
                try:
                    self.agent.remove_remote_agent(peer.nixl_name)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            self.agent.deregister_memory(self._reg)
            if self.read_failed:
                _keep_forever(self.agent)
            self.agent = None

    def _reads_in_flight(self) -> bool:
        with self.lock:
            return any(p.reads_in_flight for p in self._peers.values())


class NixlStream:
    """A reader-only second agent and the one thread that uses it: part of a large pull moves
    through it while the caller's thread moves the rest. Never handed out as an owner."""

    def __init__(self, name: str, cache: torch.Tensor) -> None:
        self.reader = NixlReader(name, cache)
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name)

    def submit(self, parts: list[ReadPart], deadline: float) -> concurrent.futures.Future:
        return self._thread.submit(self.reader.read, parts, deadline)

    def close(self) -> None:
        # The reader first: its close ends a running read at once (else by its deadline);
        # reads still queued then fail at their start.
        self.reader.close()
        self._thread.shutdown(wait=True)


def join_streams(futures: list[concurrent.futures.Future], deadline: float,
                 error: TransferError | None) -> TransferError | None:
    """Waits for every stream's share of a pull; the first error, marked when any share's
    bytes may still land. Never returns while a stream could still be writing unknowingly."""
    for f in futures:
        err = _share_error(f, deadline)
        if err is None:
            continue
        if error is None:
            error = err
        else:
            error.writes_may_land = error.writes_may_land or err.writes_may_land
    return error


def _share_error(f: concurrent.futures.Future, deadline: float) -> TransferError | None:
    try:
        try:
            f.result(timeout=max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError as e:
            if isinstance(e, TransferError):
                raise
            # Still queued behind another pull's share on its stream (one with a stalled
            # owner): it never starts, so nothing of it can land.
            if f.cancel():
                return TransferTimeout("a parallel share of a KV pull waited past its "
                                       "deadline behind another pull; nothing was posted")
            f.result(timeout=_STREAM_GRACE_S)  # running: it honours the deadline itself
        return None
    except TransferError as e:  # first: a TransferTimeout is a TimeoutError too
        return e
    except concurrent.futures.TimeoutError:
        # Its thread is stuck inside NIXL, the READ unreleased.
        return TransferTimeout("a parallel share of a KV pull did not finish",
                               writes_may_land=True)
    except concurrent.futures.CancelledError:
        return TransferTimeout("a parallel share of a KV pull was cancelled before it began")
    except Exception as e:  # noqa: BLE001 - a bug in a share: its bytes are unknown
        return TransferError(f"a parallel share of a KV pull failed: {e!r}",
                             writes_may_land=True)
