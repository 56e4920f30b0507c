"""The engine's side of KV transfer: its ranks' handles, pulls into its blocks, and releases.

Prefill role: every rank's cache is served by its rank's agent; release notifications that
readers send after their pulls arrive at rank 0's agent and free the request's lease at once
(a background thread polls, so releases apply even while the engine is idle; it also reclaims
expired leases when no step runs). Only a prefill engine leases blocks, so only it polls
often; in other roles the thread wakes just to end expired quarantines. Decode role: ``pull``
writes a remote prompt's blocks into the blocks the engine allocated, on every local rank at
once (ranks 1.. in their worker processes), without the engine's step lock: decode steps go on
meanwhile.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

from engine.kv_release_sender import ReleaseSender
from engine.outputs import KVAllocation
from engine.thread_names import named_thread
from kvtransfer import KVAgentHandle, TransferStats, TransferTimeout
from kvtransfer.plan import plan_pull

logger = logging.getLogger(__name__)

RELEASE_PREFIX = b"release:"
# A prefill engine's release polling: a lease outlives its read by up to this (its blocks stay
# cached for prefix reuse anyway). Each wake-up takes the GIL from the engine thread, so not
# more often than needed.
_POLL_S = 0.02
# Lease expiry is coarse (the lease timeout is tens of seconds): check twice a second.
_EXPIRE_EVERY_S = 0.5
# A worker rank's pull ends by its own timeout; this covers the reply's trip back.
_WORKER_REPLY_GRACE_S = 10.0


@dataclass
class KVConnectorCounters:
    """Totals over this engine: rank 0's agent plus what the engine itself tracks."""

    transfers: int
    bytes: int
    failures: int
    timeouts: int
    releases_received: int
    expired_leases: int


def _writes_may_land(error: BaseException, futures: list) -> bool:
    """Whether a failed pull may still write into its destination blocks on some rank."""
    if getattr(error, "writes_may_land", False):
        return True
    for f in futures:
        if not f.done():  # the worker never answered: its READ may still be running
            return True
        if getattr(f.exception(), "writes_may_land", False):
            return True
    return False


class KVConnector:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.agent = engine.executor.kv_agent
        self.handles: list[KVAgentHandle] = engine.executor.kv_handles()
        self.num_released = 0
        if engine.config.role == "prefill":  # readers pull only while blocks are leased
            self.agent.expect_reads(lambda: engine.num_leases > 0)
        # A failed pull's release goes out on these threads: sent on the pull's, an owner
        # that never answers held the pull's error back for the notification's timeout.
        self._releases = ReleaseSender(self.agent.send_notification)
        self._stop = threading.Event()
        self._poller = named_thread(self._poll_releases, "pdserve-kv-release")
        self._poller.start()

    def preconnect(self, remotes: list[KVAgentHandle]) -> bool:
        """Connects rank 0 to a peer engine's ranks before a pull needs them (ranks 1.. still
        connect on their first pull); whether the backend had anything to set up. Refuses a
        peer whose layout this engine could not read, as a pull would."""
        plan_pull(self.agent.layout, self.agent.backend, list(remotes), [], [])
        return all([self.agent.preconnect(r) for r in remotes])

    def forget_peers(self, agent_names: list[str]) -> list[str]:
        """Drops every rank's connections to these remote agents (peers gone for good); the
        names rank 0 still uses (a transfer with them in flight), to try again later. Ranks
        1.. keep a peer they are reading from, which their next forget drops."""
        names = [str(n) for n in agent_names]
        self.engine.executor.forget_worker_peers(names)
        return [n for n in names if not self.agent.forget_peer(n)]

    def peer_names(self) -> list[str]:
        """The remote agents rank 0 holds connections to."""
        return self.agent.peer_names()

    def pull(self, alloc: KVAllocation, remotes: list[KVAgentHandle],
             remote_block_ids: list[int], deadline: float,
             lease_id: str | None = None) -> TransferStats:
        """Fills ``alloc.block_ids_to_fill`` from the matching tail of ``remote_block_ids``
        on every local rank, no rank posting a read after ``deadline`` (time.monotonic());
        then tells the owner to release its lease (``lease_id``; default: the request's id)."""
        if not isinstance(alloc, KVAllocation):
            raise ValueError(f"alloc must be a KVAllocation, got {type(alloc).__name__}")
        if not isinstance(remotes, (list, tuple)) or not remotes:
            raise ValueError("remotes must be a non-empty list of KVAgentHandle")
        if lease_id is not None and not isinstance(lease_id, str):
            raise ValueError(f"lease_id must be a string, got {type(lease_id).__name__}")
        notify = RELEASE_PREFIX + (lease_id or alloc.request_id).encode()
        try:
            if len(remote_block_ids) != len(alloc.block_ids):
                raise ValueError(f"the remote holds {len(remote_block_ids)} blocks; the "
                                 f"request needs {len(alloc.block_ids)}")
            remote_ids = list(remote_block_ids[alloc.num_cached_blocks:])
            local_ids = alloc.block_ids_to_fill
            # Rank 0 checks layouts and ids before any rank moves a byte.
            plan_pull(self.agent.layout, self.agent.backend, list(remotes), remote_ids,
                      local_ids)
        except ValueError:
            # Nothing will be read here, as after a failed pull: the router, which takes
            # this INVALID_ARGUMENT for a reader that may be reading, leaves the lease to
            # this word (else held until its expiry).
            self._release_after_failure(remotes[0], notify)
            raise
        t0 = time.monotonic()
        timeout_s = deadline - t0
        if timeout_s <= 0:
            self._release_after_failure(remotes[0], notify)
            raise TransferTimeout("the KV pull's deadline passed before it started")
        futures = self.engine.executor.start_worker_pulls(list(remotes), remote_ids, local_ids,
                                                          deadline)
        error: BaseException | None = None
        stats: list[TransferStats] = []
        try:
            # With one rank the release can ride on the pull itself; with more it waits for all.
            stats.append(self.agent.pull(list(remotes), remote_ids, local_ids, timeout_s,
                                         notify=None if futures else notify,
                                         deadline=deadline))
        except BaseException as e:  # noqa: BLE001 - the workers must finish before we raise
            error = e
        for f in futures:  # never return while a worker may still write into the blocks
            try:
                stats.append(f.result(timeout=max(0.0, deadline - time.monotonic())
                                      + _WORKER_REPLY_GRACE_S))
            except concurrent.futures.TimeoutError:
                error = error or TransferTimeout("a tensor-parallel rank's KV pull did not "
                                                 "answer in time")
            except BaseException as e:  # noqa: BLE001
                error = error or e
        if error is not None:
            if _writes_may_land(error, futures):
                self.engine.quarantine_kv(alloc.request_id)
            self._release_after_failure(remotes[0], notify)
            raise error
        if futures:
            self.agent.send_notification(remotes[0], notify)
        return TransferStats(len(local_ids), sum(s.num_bytes for s in stats),
                             sum(s.num_descriptors for s in stats), time.monotonic() - t0)

    def _release_after_failure(self, owner: KVAgentHandle, notify: bytes) -> None:
        # A failed pull commits nothing (its blocks are freed, or quarantined while a read may
        # still land in them), so the owner may reuse the lease's blocks now: a router that
        # cut the request mid-pull left them to this reader's word (ReleaseKV may_be_read),
        # which would otherwise come only with the lease's expiry. Best effort, and off this
        # thread: an owner that is gone has nothing to free, and the pull's error must not
        # wait on one that does not answer.
        self._releases.submit(owner, notify)

    def release_unread(self, remotes: list[KVAgentHandle], lease_id: str) -> None:
        """Tells the owner that lease ``lease_id`` will not be read here: its request was cut
        before this engine posted any read of it. The router's release of a lease a reader may
        still be reading leaves its blocks held until the reader says its read is over."""
        if not isinstance(lease_id, str) or not lease_id:
            raise ValueError("lease_id must be a non-empty string")
        self.agent.send_notification(remotes[0], RELEASE_PREFIX + lease_id.encode())

    def counters(self) -> KVConnectorCounters:
        c = self.agent.counters()
        return KVConnectorCounters(c.transfers, c.bytes, c.failures, c.timeouts,
                                   self.num_released, self.engine.num_expired_leases)

    def _poll_interval(self) -> float:
        """Release notifications only reach an engine that leases blocks (the prefill role);
        elsewhere only expiries are due, which are coarse."""
        return _POLL_S if self.engine.config.role == "prefill" else _EXPIRE_EVERY_S

    def _poll_releases(self) -> None:
        interval = self._poll_interval()
        next_expiry = time.monotonic() + _EXPIRE_EVERY_S
        while not self._stop.wait(interval):
            try:
                msgs = self.agent.poll_notifications()
            except Exception:  # noqa: BLE001 - the agent closed under us at shutdown
                if self._stop.is_set():
                    return
                logger.exception("polling KV release notifications failed")
                continue
            for msg in msgs:
                if msg.startswith(RELEASE_PREFIX):
                    self.num_released += 1
                    self.engine.release_kv(msg[len(RELEASE_PREFIX):].decode(errors="replace"))
            if time.monotonic() >= next_expiry:
                next_expiry = time.monotonic() + _EXPIRE_EVERY_S
                self.engine.reclaim_expired_leases()

    def close(self) -> None:
        self._stop.set()
        self._releases.close()
        self._poller.join(timeout=5)

