"""The agent interface every backend implements, and the checks they share.

One agent per TP rank, over that rank's whole cache tensor
``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]``. An agent is both an
owner (remote readers pull its blocks; it receives their release notifications) and a reader
(``pull`` copies remote blocks into its own cache). All validation happens here, before a
backend moves a byte, so both backends refuse the same inputs with the same errors.
"""
from __future__ import annotations

import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace

import torch

from engine.kv_layout import KVCacheLayout, dtype_name
from kvtransfer.errors import TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle
from kvtransfer.plan import PullJob, plan_pull
from kvtransfer.types import TransferCounters, TransferStats


# The longest a pull may be given: a day is far beyond any KV transfer, and well inside what
# lock, socket and timedelta waits accept.
MAX_TIMEOUT_S = 86400.0


class KVTransferAgent(ABC):
    backend: str

    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, name: str | None) -> None:
        if not isinstance(layout, KVCacheLayout):
            raise ValueError(f"layout must be a KVCacheLayout, got {type(layout).__name__}")
        if tuple(cache.shape) != layout.shape or not cache.is_contiguous():
            raise ValueError(f"cache of shape {tuple(cache.shape)} (contiguous: "
                             f"{cache.is_contiguous()}) does not match layout {layout.shape}")
        if dtype_name(cache.dtype) != layout.dtype:
            raise ValueError(f"cache dtype {cache.dtype} does not match layout {layout.dtype}")
        self.cache = cache
        self.layout = layout
        self.name = name or f"pdserve-kv-{os.getpid()}-r{layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.mem_type = "VRAM" if cache.is_cuda else "DRAM"
        self.device_id = (cache.device.index or 0) if cache.is_cuda else 0
        self._counters = TransferCounters()
        self._counters_lock = threading.Lock()
        self._reads_due: Callable[[], bool] | None = None

    # --- what backends implement ------------------------------------------------------------
    @abstractmethod
    def handle(self) -> KVAgentHandle:
        """What a remote reader needs to pull from this rank's cache."""

    @abstractmethod
    def _run_pull(self, jobs: list[PullJob], deadline: float, notify: bytes | None) -> tuple[int, bool]:
        """Moves the jobs' bytes; (descriptors or messages used, whether ``notify`` went out
        with the data). Raises TransferError (or a subclass) on failure or at ``deadline``."""

    @abstractmethod
    def _send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        ...

    @abstractmethod
    def _poll_notifications(self) -> list[bytes]:
        ...

    @abstractmethod
    def forget_peer(self, agent_name: str) -> bool:
        """Drops what this reader holds for remote ``agent_name`` (its connection, its loaded
        metadata): a peer gone for good. A later pull from it connects again. Whether it is
        gone now; False while a transfer with it runs (the caller tries again later)."""

    @abstractmethod
    def peer_names(self) -> list[str]:
        """The remote agents this reader holds something for, sorted."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving and frees the backend's resources; idempotent."""

    def expect_reads(self, reads_due: Callable[[], bool] | None) -> None:
        """Tells an owner when remote reads of its blocks are due (a prefill engine: while it
        holds leased blocks). A backend that must serve reads actively (NIXL over TCP) then
        does so promptly only meanwhile. The agent's own threads call ``reads_due``, so it must
        be cheap and thread-safe; None: the agent guesses from the notifications it receives."""
        self._reads_due = reads_due

    def reads_due_soon(self) -> None:
        """Tells an owner that a read of its blocks may come now (its engine just leased
        blocks, or ran a step that may have): a backend that serves reads only while it polls
        (NIXL) polls at once and then promptly, instead of finishing an idle wait first.
        Cheap and thread-safe; nothing to do for a backend that needs no polling."""

    def _reads_due_now(self) -> bool | None:
        due = self._reads_due
        return None if due is None else bool(due())

    def preconnect(self, remote: KVAgentHandle) -> bool:
        """Sets up the connection to ``remote`` ahead of the first pull from it; whether this
        backend has anything to set up (the default: no)."""
        return False

    # --- the shared surface -------------------------------------------------------------------
    def pull(self, remotes: list[KVAgentHandle], remote_block_ids: list[int],
             local_block_ids: list[int], timeout_s: float,
             notify: bytes | None = None, deadline: float | None = None) -> TransferStats:
        """Reads ``remote_block_ids`` of the remote ranks into ``local_block_ids`` here.

        Every remote rank whose KV heads overlap this rank's contributes its head slice.
        ``notify`` reaches the first remote (the owner's rank 0) only after all data landed.
        ``deadline`` (time.monotonic(), the same clock in every process of a host): no read
        is posted after it, however long the pull waited to start. A caller whose deadline is
        an owner's lease needs it: a read past the lease could copy blocks the owner gave to
        another prompt.
        """
        check_timeout(timeout_s)
        if notify is not None and not isinstance(notify, bytes):
            raise ValueError(f"notify must be bytes or None, got {type(notify).__name__}")
        jobs = plan_pull(self.layout, self.backend, remotes, remote_block_ids, local_block_ids)
        t0 = time.monotonic()
        end = t0 + timeout_s if deadline is None else min(t0 + timeout_s, float(deadline))
        num_desc, notified = 0, False
        if len(local_block_ids):  # else everything was in the reader's prefix cache already
            try:
                if time.monotonic() >= end:
                    raise TransferTimeout("KV pull started after its deadline; nothing was "
                                          "posted")
                num_desc, notified = self._run_pull(jobs, end, notify)
            except TransferError as e:
                with self._counters_lock:
                    self._counters.failures += 1
                    self._counters.timeouts += isinstance(e, TransferTimeout)
                raise
        if notify and not notified:
            self.send_notification(remotes[0], notify)
        num_bytes = sum(j.num_bytes for j in jobs)
        with self._counters_lock:
            self._counters.transfers += 1
            self._counters.bytes += num_bytes
            self._counters.notifications_sent += notified
        return TransferStats(len(local_block_ids), num_bytes, num_desc, time.monotonic() - t0)

    def send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        """Sends ``msg`` to ``remote``'s agent (it shows up in its ``poll_notifications``)."""
        if not isinstance(remote, KVAgentHandle) or remote.backend != self.backend:
            raise ValueError(f"cannot notify {remote!r} from a {self.backend} agent")
        if not isinstance(msg, bytes) or not msg:
            raise ValueError("a notification is non-empty bytes")
        self._send_notification(remote, msg)
        with self._counters_lock:
            self._counters.notifications_sent += 1

    def poll_notifications(self) -> list[bytes]:
        """Notifications received as an owner since the last poll."""
        msgs = self._poll_notifications()
        if msgs:
            with self._counters_lock:
                self._counters.notifications_received += len(msgs)
        return msgs

    def counters(self) -> TransferCounters:
        with self._counters_lock:
            return replace(self._counters)

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_timeout(timeout_s: object) -> None:
    """ValueError unless ``timeout_s`` is a number of seconds in (0, MAX_TIMEOUT_S]: inf or
    1e12 overflowed the lock and socket waits (OverflowError, answered as INTERNAL)."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
            or not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout_s must be > 0 and at most {MAX_TIMEOUT_S:.0f} seconds, "
                         f"got {timeout_s!r}")


def check_deadline(deadline: float, what: str) -> float:
    """Seconds left before ``deadline``; TransferTimeout when none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout(f"{what} did not complete within its timeout")
    return left
