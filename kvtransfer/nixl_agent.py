"""KV transfer over NIXL (UCX): one agent per rank, the rank's whole cache registered once.

Reads are one-sided: the owner's CPU does nothing while a reader pulls (its agent's progress
thread serves UCX). A pull is one batched READ per remote rank, with a descriptor per
contiguous run: a (layer, K/V, block) when both sides hold the same heads, a (layer, K/V,
block, token) row slice under heterogeneous TP, where the remote heads are a slice of each
local token row. When a pull reads from a single remote rank, the release notification rides
on that READ: NIXL delivers it to the owner once the data has landed, exactly when the owner
may reuse the blocks. With several remote ranks it is sent after every READ completed, since a
notification on one READ says nothing about the others.

Between processes on one host UCX moves host memory by CMA (``process_vm_readv``), inside the
posting call: one READ is one thread copying. With ``pull_streams`` = k > 1, a pull of at least
``SPLIT_MIN_BYTES`` is cut into k shares of about equal bytes; the caller's thread posts one,
and k - 1 more agents (each its own UCX context, worker and thread) post the others, so k
threads copy at once. That takes k cores for the length of the pull, so it is off by default: a
decode worker on a one-core budget would take its prefill neighbour's core.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from engine.kv_layout import KVCacheLayout
from engine.thread_names import named_thread
from kvtransfer.agent import KVTransferAgent
from kvtransfer.errors import PeerGoneError, TransferError
from kvtransfer.handle import KVAgentHandle
from kvtransfer.nixl_reader import NixlReader, NixlStream, ReadPart, join_streams
from kvtransfer.plan import PullJob, block_runs, descriptors, split_runs

logger = logging.getLogger(__name__)
# How often an owner's UCX worker is progressed when nothing else touches it: connection
# set-up from a new reader (and, over TCP, every READ) waits for the owner's progress.
_OWNER_PROGRESS_S = 0.001
# An owner polls every _OWNER_IDLE_PROGRESS_S instead when no read is due: when its engine told
# it when reads are due (``expect_reads``: while it holds leased blocks) and holds none, else
# once no notification came for _OWNER_IDLE_AFTER_S. 1 ms wake-ups cost an idle prefill worker
# ~5% of a core, and on a host whose cores it shares they interrupt the co-located decode
# worker's steps: a prefill worker kept on the fast loop by one release notice a request
# slowed the decode worker's batch-1 step by 0.5 ms (7.2 against 6.7 ms, session 13).
# A read waits for its owner's progress (measured on the 2-core VM: a pull of 10 blocks from a
# prefill engine took 1-20 ms, mean 8.4, while its owner slept out an idle interval, 1.5 ms on
# the fast loop), so an engine that leases blocks wakes its agent (``reads_due_soon``) and a
# read never waits for an idle interval to end.
_OWNER_IDLE_AFTER_S = 1.0
_OWNER_IDLE_PROGRESS_S = 0.02
# An agent nobody reads from (a decode engine's: it only pulls) still wakes now and then, for
# UCX housekeeping; every wake-up takes the GIL from its engine (a 1 ms loop measured 4-5% of
# a decode worker's step time on one core).
_READER_PROGRESS_S = 0.05
# Smaller pulls stay on the caller's thread: handing a share to a stream costs about 0.1 ms, and
# up to 4 MB two threads measured no faster than one (from 16 MB on, 1.7-1.9x).
SPLIT_MIN_BYTES = 8 << 20
MAX_PULL_STREAMS = 16


def progress_interval(serves_reads: bool, quiet_s: float, reads_due: bool | None = None) -> float:
    """Seconds between progress polls for an agent whose last notification came ``quiet_s``
    ago; ``reads_due``: whether its engine expects reads now (None: it never said)."""
    if not serves_reads:
        return _READER_PROGRESS_S
    if reads_due is None:
        reads_due = quiet_s < _OWNER_IDLE_AFTER_S
    return _OWNER_PROGRESS_S if reads_due else _OWNER_IDLE_PROGRESS_S


def pull_streams_setting(pull_streams: int | None) -> int:
    """``pull_streams``, or $PDSERVE_NIXL_PULL_STREAMS when None (default 1), checked."""
    if pull_streams is None:
        raw = os.environ.get("PDSERVE_NIXL_PULL_STREAMS", "1")
        try:
            pull_streams = int(raw)
        except ValueError:
            raise ValueError(f"PDSERVE_NIXL_PULL_STREAMS must be an integer, got {raw!r}") from None
    if isinstance(pull_streams, bool) or not isinstance(pull_streams, int) or not (
            1 <= pull_streams <= MAX_PULL_STREAMS):
        raise ValueError(f"pull_streams must be an integer in [1, {MAX_PULL_STREAMS}], got "
                         f"{pull_streams!r}")
    return pull_streams


class NixlKVAgent(KVTransferAgent):
    backend = "nixl"

    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, name: str | None = None,
                 pull_streams: int | None = None, serves_reads: bool = True) -> None:
        super().__init__(cache, layout, name)
        self._serves_reads = serves_reads
        self.pull_streams = pull_streams_setting(pull_streams)
        # NIXL's progress thread polls UCX with no delay: on a CPU host it takes half a core per
        # process (measured: serving throughput halved on 2 cores). Readers progress UCX in
        # their completion polling; owners in a thread of ours that sleeps between polls.
        prog = os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD") == "1"
        self._main = NixlReader(self.name, cache, prog)
        self._streams: list[NixlStream] = []
        try:
            for i in range(1, self.pull_streams):
                self._streams.append(NixlStream(f"{self.name}-s{i}", cache))
        except BaseException:
            for s in self._streams:
                s.close()
            self._main.close()
            raise
        self._notifs: list[bytes] = []  # received, not yet polled by the caller
        self._closed = threading.Event()
        # Set by close() and reads_due_soon(): either ends the progress thread's wait early.
        self._wake = threading.Event()
        self._reads_announced = False
        # "kv-progress-R" to the OS (its 15 bytes); the agent's own name is too long for it.
        self._progress = named_thread(self._progress_loop,
                                      f"pdserve-kv-progress-{layout.tp_rank}")
        self._progress.start()

    def handle(self) -> KVAgentHandle:
        return KVAgentHandle(
            backend="nixl", agent_name=self.name, metadata=self._main.agent.get_agent_metadata(),
            base_addr=self.cache.data_ptr(),
            num_bytes=self.cache.numel() * self.cache.element_size(),
            device_id=self.device_id, mem_type=self.mem_type, layout=self.layout)

    def _part(self, job: PullJob) -> ReadPart:
        r = job.remote
        rids, lids, runs = job.remote_ids, job.local_ids, None
        if job.whole_rows:  # neighbouring blocks on both sides move as one run
            # A split pull needs runs to share out: none longer than a stream's share.
            split = self._streams and job.num_bytes >= SPLIT_MIN_BYTES
            share = -(-len(lids) // (1 + len(self._streams))) if split else None
            rids, lids, runs = block_runs(job.remote_ids, job.local_ids, share)
        rdesc = descriptors(r.layout, r.base_addr, rids, job.head_start, job.num_heads,
                            r.device_id, not job.whole_rows, runs)
        ldesc = descriptors(self.layout, self.cache.data_ptr(), lids, job.head_start,
                            job.num_heads, self.device_id, not job.whole_rows, runs)
        return ReadPart(r, rdesc, ldesc)

    def _shares(self, parts: list[ReadPart], num_bytes: int) -> list[list[ReadPart]]:
        """What each thread moves: the caller's share first, then each stream's."""
        if not self._streams or num_bytes < SPLIT_MIN_BYTES:
            return [parts]
        shares: list[list[ReadPart]] = [[] for _ in range(1 + len(self._streams))]
        for p in parts:
            for share, sl in zip(shares, split_runs(p.rdesc[:, 1], len(shares))):
                if sl.stop > sl.start:
                    share.append(ReadPart(p.remote, p.rdesc[sl], p.ldesc[sl]))
        return shares

    def _run_pull(self, jobs: list[PullJob], deadline: float,
                  notify: bytes | None) -> tuple[int, bool]:
        parts = [self._part(job) for job in jobs]
        shares = self._shares(parts, sum(j.num_bytes for j in jobs))
        attach = (bool(notify) and len(jobs) == 1 and jobs[0].remote_index == 0
                  and len(shares) == 1)
        futures = [s.submit(share, deadline)
                   for s, share in zip(self._streams, shares[1:]) if share]
        error: TransferError | None = None
        try:
            self._main.read(shares[0], deadline, notify if attach else b"")
        except TransferError as e:
            error = e
        finally:  # the streams' shares end (or are marked as possibly landing) before we return
            error = join_streams(futures, deadline, error)
        if error is not None:
            raise error
        return sum(len(p.rdesc) for p in parts), attach

    def _send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        try:
            with self._main.lock:
                if self._main.agent is None:
                    raise RuntimeError("the agent is closed")
                self._main.agent.send_notif(self._main.connect(remote), msg)
        except Exception as e:  # noqa: BLE001
            raise PeerGoneError(f"cannot notify {remote.agent_name!r}: {e}") from None

    def preconnect(self, remote: KVAgentHandle) -> bool:
        """Loads ``remote``'s metadata and opens the UCX connection on every reader now: the
        first pull from a new peer otherwise pays for both (29 ms for a 2-block pull, 4.5 ms
        with the connection made ahead, measured on the 2-core VM). ``remote`` is the owner's
        own handle (from the registry): it is believed over any handle met before."""
        if remote.backend != "nixl":
            raise ValueError(f"a NIXL agent cannot connect to a {remote.backend!r} handle")
        for reader in [self._main, *(s.reader for s in self._streams)]:
            with reader.lock:
                if reader.agent is None:
                    raise RuntimeError("the agent is closed")
                try:
                    reader.agent.make_connection(reader.connect(remote, trusted=True))
                except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
                    raise PeerGoneError(f"cannot connect to NIXL agent {remote.agent_name!r}: "
                                        f"{e}") from None
        return True

    def forget_peer(self, agent_name: str) -> bool:
        readers = [self._main, *(s.reader for s in self._streams)]
        return all([r.forget(agent_name) for r in readers])

    def peer_names(self) -> list[str]:
        return self._main.peer_names()

    def reads_due_soon(self) -> None:
        if self._serves_reads:
            self._reads_announced = True
            self._wake.set()

    def _progress_loop(self) -> None:
        # Fetching notifications progresses the UCX worker, which serves remote readers.
        last_notice = time.monotonic()  # an owner starts on the fast loop
        interval = progress_interval(self._serves_reads, 0.0, self._reads_due_now())
        while True:
            self._wake.wait(interval)
            self._wake.clear()
            if self._closed.is_set():
                return
            if self._reads_announced:  # counts as a notice: fast polls for a while
                self._reads_announced = False
                last_notice = time.monotonic()
            with self._main.lock:
                if self._main.agent is None:
                    return
                try:
                    notifs = self._main.agent.get_new_notifs()
                except Exception:  # noqa: BLE001 - keep serving; the next poll retries
                    logger.exception("NIXL progress failed")
                    continue
                got = [m for msgs in notifs.values() for m in msgs]
                self._notifs.extend(got)
            now = time.monotonic()
            if got:
                last_notice = now
            interval = progress_interval(self._serves_reads, now - last_notice,
                                         self._reads_due_now())

    def _poll_notifications(self) -> list[bytes]:
        with self._main.lock:
            msgs, self._notifs = self._notifs, []
        return msgs

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        if threading.current_thread() is not self._progress:
            self._progress.join(timeout=5)
        for s in self._streams:
            s.close()
        self._main.close()
