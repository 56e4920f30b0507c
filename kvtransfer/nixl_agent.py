"""KV transfer over NIXL (UCX): one agent per rank, the rank's whole cache registered once.

Reads are one-sided: the owner's CPU does nothing while a reader pulls (its agent's progress
thread serves UCX). The reader attaches a notification to the transfer that carries the
request's release message; NIXL delivers it to the owner when the data has landed, which is
exactly when the owner may reuse the blocks.
"""
from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv_layout import KVCacheLayout
from kvtransfer.errors import TransferError, TransferTimeout
from kvtransfer.handle import KVAgentHandle
from kvtransfer.plan import check_block_ids, descriptors, plan_heads

logger = logging.getLogger(__name__)
_POLL_S = 0.0002


@dataclass
class TransferStats:
    num_blocks: int
    num_bytes: int
    num_descriptors: int
    seconds: float


@dataclass
class TransferCounters:
    transfers: int = 0
    bytes: int = 0
    failures: int = 0
    timeouts: int = 0


class NixlKVAgent:
    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, name: str | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        if tuple(cache.shape) != layout.shape or not cache.is_contiguous():
            raise ValueError(f"cache of shape {tuple(cache.shape)} (contiguous: "
                             f"{cache.is_contiguous()}) does not match layout {layout.shape}")
        self.cache = cache
        self.layout = layout
        self.name = name or f"pdserve-kv-{os.getpid()}-r{layout.tp_rank}-{uuid.uuid4().hex[:8]}"
        self.mem_type = "VRAM" if cache.is_cuda else "DRAM"
        self.device_id = (cache.device.index or 0) if cache.is_cuda else 0
        self._agent = nixl_agent(self.name, nixl_agent_config(backends=["UCX"]))
        self._reg = self._agent.register_memory(cache)
        self._remotes: dict[str, str] = {}  # agent name -> name NIXL knows it by
        self._lock = threading.Lock()  # NIXL calls from the loop's threads and the poller
        self.counters = TransferCounters()
        self._ids = itertools.count()

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

    def pull(self, remotes: list[KVAgentHandle], remote_block_ids: list[int],
             local_block_ids: list[int], timeout_s: float,
             notify: bytes | None = None) -> TransferStats:
        """Reads ``remote_block_ids`` of the remote ranks into ``local_block_ids`` here.

        Every remote rank whose KV heads overlap this rank's contributes its slice. ``notify``
        goes to the first remote (the owner's rank 0) once its data has landed.
        """
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks but "
                             f"{len(local_block_ids)} local blocks")
        if not remotes:
            raise ValueError("no remote ranks to pull from")
        slices = plan_heads(self.layout, [r.layout for r in remotes])
        local_ids = check_block_ids(local_block_ids, self.layout.num_blocks, "local")
        if local_ids.size == 0:  # everything was in the reader's prefix cache already
            if notify:
                self.send_notification(remotes[0], notify)
            return TransferStats(0, 0, 0, 0.0)
        # Every check happens before the first byte moves.
        jobs = []
        for sl in slices:
            remote = remotes[sl.remote_index]
            rlay = remote.layout
            rids = check_block_ids(remote_block_ids, rlay.num_blocks, "remote")
            per_token = not (sl.num == self.layout.num_kv_heads == rlay.num_kv_heads)
            rdesc = descriptors(rlay, remote.base_addr, rids, sl.start, sl.num,
                                remote.device_id, per_token)
            ldesc = descriptors(self.layout, self.cache.data_ptr(), local_ids, sl.start,
                                sl.num, self.device_id, per_token)
            msg = notify if (notify and sl.remote_index == 0) else b""
            jobs.append((remote, rdesc, ldesc, msg))
        t0 = time.monotonic()
        handles: list = []
        try:
            with self._lock:
                for remote, rdesc, ldesc, msg in jobs:
                    handles.append(self._start_read(remote, rdesc, ldesc, msg))
            self._wait(handles, t0 + timeout_s, remotes)
        except TransferError:
            self.counters.failures += 1
            raise
        finally:
            self._release(handles)
        total_bytes = sum(int(j[2][:, 1].sum()) for j in jobs)
        total_descs = sum(len(j[2]) for j in jobs)
        if notify and not any(s.remote_index == 0 for s in slices):
            self.send_notification(remotes[0], notify)
        self.counters.transfers += 1
        self.counters.bytes += total_bytes
        return TransferStats(len(local_block_ids), total_bytes, total_descs,
                             time.monotonic() - t0)

    def _start_read(self, remote: KVAgentHandle, rdesc: np.ndarray, ldesc: np.ndarray,
                    msg: bytes):
        try:
            name = self._connect(remote)
            h = self._agent.initialize_xfer(
                "READ", self._agent.get_xfer_descs(ldesc, self.mem_type),
                self._agent.get_xfer_descs(rdesc, remote.mem_type), name, msg)
            state = self._agent.transfer(h)
        except Exception as e:  # noqa: BLE001 - NIXL raises its own exception types
            raise TransferError(f"cannot read from {remote.agent_name!r}: {e}") from None
        if state == "ERR":
            self._agent.release_xfer_handle(h)
            raise TransferError(f"NIXL refused the read from {remote.agent_name!r}")
        return h

    def _wait(self, handles: list, deadline: float, remotes: list[KVAgentHandle]) -> None:
        pending = list(handles)
        while pending:
            try:
                with self._lock:
                    states = [self._agent.check_xfer_state(h) for h in pending]
            except Exception as e:  # noqa: BLE001
                raise TransferError(f"a NIXL read failed: {e}") from None
            if "ERR" in states:
                raise TransferError("a NIXL read failed (is the owner "
                                    f"{remotes[0].agent_name!r} still alive?)")
            pending = [h for h, s in zip(pending, states) if s != "DONE"]
            if pending:
                if time.monotonic() > deadline:
                    self.counters.timeouts += 1
                    raise TransferTimeout(f"KV pull from {remotes[0].agent_name!r} did not "
                                          f"complete in time")
                time.sleep(_POLL_S)

    def _release(self, handles: list) -> None:
        with self._lock:
            for h in handles:
                try:
                    self._agent.release_xfer_handle(h)
                except Exception as e:  # noqa: BLE001 - a stuck handle must not mask the error
                    logger.warning("could not release a NIXL transfer handle: %s", e)

    def send_notification(self, remote: KVAgentHandle, msg: bytes) -> None:
        try:
            with self._lock:
                self._agent.send_notif(self._connect(remote), msg)
        except Exception as e:  # noqa: BLE001
            raise TransferError(f"cannot notify {remote.agent_name!r}: {e}") from None

    def poll_notifications(self) -> list[bytes]:
        with self._lock:
            notifs = self._agent.get_new_notifs()
        return [m for msgs in notifs.values() for m in msgs]

    def close(self) -> None:
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
