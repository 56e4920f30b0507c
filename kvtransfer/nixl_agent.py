"""KV transfer over NIXL (UCX): one agent per rank, the rank's whole cache registered once.

Reads are one-sided: the owner's CPU does nothing while a reader pulls (its agent's progress
thread serves UCX). A pull is one batched READ per remote rank, with a descriptor per
contiguous run: a (layer, K/V, block) when both sides hold the same heads, a (layer, K/V,
block, token) row slice under heterogeneous TP, where the remote heads are a slice of each
local token row. When a pull reads from a single remote rank, the release notification rides
on that READ: NIXL delivers it to the owner once the data has landed, exactly when the owner
may reuse the blocks. With several remote ranks it is sent after every READ completed, since a
notification on one READ says nothing about the others.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer.agent import KVTransferAgent
from kvtransfer.errors import PeerGoneError, TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle
from kvtransfer.plan import PullJob, block_runs, descriptors

logger = logging.getLogger(__name__)
# Completion polling interval: short, since a READ of a few MB finishes in about a millisecond.
_POLL_S = 0.0002
# How often an owner's UCX worker is progressed when nothing else touches it: connection
# set-up from a new reader (and, over TCP, every READ) waits for the owner's progress.
_OWNER_PROGRESS_S = 0.001


class NixlKVAgent(KVTransferAgent):
    backend = "nixl"

    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, name: str | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        super().__init__(cache, layout, name)
        # NIXL's progress thread polls UCX with no delay: on a CPU host it takes half a core per
        # process (measured: serving throughput halved on 2 cores). Readers progress UCX in
        # their completion polling; owners in a thread of ours that sleeps between polls.
        prog = os.environ.get("PDSERVE_NIXL_PROGRESS_THREAD") == "1"
        self._agent = nixl_agent(self.name, nixl_agent_config(enable_prog_thread=prog,
                                                              backends=["UCX"]))
        self._reg = self._agent.register_memory(cache)
        self._remotes: dict[str, str] = {}  # agent name -> name NIXL knows it by
        # NIXL's agent is used from the engine's pull threads and the owner progress thread.
        self._lock = threading.Lock()
        self._notifs: list[bytes] = []  # received, not yet polled by the caller
        self._closed = threading.Event()
        self._progress = threading.Thread(target=self._progress_loop, daemon=True,
                                          name=f"{self.name}-progress")
        self._progress.start()

    def handle(self) -> KVAgentHandle:
        return KVAgentHandle(
            backend="nixl", agent_name=self.name, metadata=self._agent.get_agent_metadata(),
            base_addr=self.cache.data_ptr(),
            num_bytes=self.cache.numel() * self.cache.element_size(),
            device_id=self.device_id, mem_type=self.mem_type, layout=self.layout)

    def _connect(self, remote: KVAgentHandle) -> str:
        known = self._remotes.get(remote.agent_name)
        if known is None:
            known = self._agent.add_remote_agent(remote.metadata)
            if isinstance(known, bytes):
                known = known.decode()
            self._remotes[remote.agent_name] = known
        return known

    def _run_pull(self, jobs: list[PullJob], deadline: float,
                  notify: bytes | None) -> tuple[int, bool]:
        attach = bool(notify) and len(jobs) == 1 and jobs[0].remote_index == 0
        plans = []
        for job in jobs:
            r = job.remote
            rids, lids, runs = job.remote_ids, job.local_ids, None
            if job.whole_rows:  # neighbouring blocks on both sides move as one run
                rids, lids, runs = block_runs(job.remote_ids, job.local_ids)
            rdesc = descriptors(r.layout, r.base_addr, rids, job.head_start, job.num_heads,
                                r.device_id, not job.whole_rows, runs)
            ldesc = descriptors(self.layout, self.cache.data_ptr(), lids, job.head_start,
                                job.num_heads, self.device_id, not job.whole_rows, runs)
            plans.append((r, rdesc, ldesc))
        handles: list = []
        try:
            if self._agent is None:
                raise TransferError(f"NIXL agent {self.name!r} is closed")
            with self._lock:
                for r, rdesc, ldesc in plans:
                    handles.append(self._start_read(r, rdesc, ldesc, notify if attach else b""))
            self._wait(handles, deadline, jobs)
        except TransferError as e:
            # Releasing a running READ asks UCX to cancel it, but nothing confirms the cancel:
            # a late completion could still write into blocks the caller is about to reuse.
            e.writes_may_land = e.writes_may_land or self._any_in_flight(handles)
            raise
        finally:
            self._release(handles)
        return sum(len(p[2]) for p in plans), attach

    def _any_in_flight(self, handles: list) -> bool:
        with self._lock:
            for h in handles:
                try:
                    if self._agent.check_xfer_state(h) not in ("DONE", "ERR"):
                        return True
                except Exception:  # noqa: BLE001 - unknown state: assume the worst
                    return True
        return False

    def _start_read(self, remote: KVAgentHandle, rdesc, ldesc, msg: bytes):
        try:
            name = self._connect(remote)
            h = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(ldesc, self.mem_type),
                self._agent.get_xfer_descs(rdesc, remote.mem_type), name, msg)
            state = self._agent.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise PeerGoneError(f"cannot read from NIXL agent {remote.agent_name!r}: {e}") from None
        if state == "ERR":
            self._agent.release_xfer_handle(h)
            raise PeerGoneError(f"NIXL refused the read from {remote.agent_name!r}")
        return h

    def _wait(self, handles: list, deadline: float, jobs: list[PullJob]) -> None:
        names = [j.remote.agent_name for j in jobs]
        pending = list(zip(handles, names))
        while pending:
            try:
                with self._lock:
                    states = [self._agent.check_xfer_state(h) for h, _ in pending]
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

    def _release(self, handles: list) -> None:
        # Releasing a handle whose READ is still running asks NIXL to abort it.
        with self._lock:
            for h in handles:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception as e:  # noqa: BLE001 - a stuck handle must not mask the error
                    logger.warning("could not release a NIXL transfer handle: %s", e)

    def _send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        try:
            with self._lock:
                if self._agent is None:
                    raise RuntimeError("the agent is closed")
                self._agent.send_notif(self._connect(remote), msg)
        except Exception as e:  # noqa: BLE001
            raise PeerGoneError(f"cannot notify {remote.agent_name!r}: {e}") from None

    def _progress_loop(self) -> None:
        # Fetching notifications progresses the UCX worker, which serves remote readers.
        while not self._closed.wait(_OWNER_PROGRESS_S):
            with self._lock:
                if self._agent is None:
                    return
                try:
                    notifs = self._agent.get_new_notifs()
                except Exception:  # noqa: BLE001 - keep serving; the next poll retries
                    logger.exception("NIXL progress failed")
                    continue
                self._notifs.extend(m for msgs in notifs.values() for m in msgs)

    def _poll_notifications(self) -> list[bytes]:
        with self._lock:
            msgs, self._notifs = self._notifs, []
        return msgs

    def close(self) -> None:
        self._closed.set()
        if threading.current_thread() is not self._progress:
            self._progress.join(timeout=5)
        with self._lock:
            if self._agent is None:
                return
            for name in self._remotes.values():
                try:
                    self._agent.remove_remote_agent(name)
                except Exception:  # noqa: BLE001 - best effort on the way out
                    pass
            self._agent.deregister_memory(self._reg)
            self._agent = None
