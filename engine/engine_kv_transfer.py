"""The engine's KV-transfer side: its cache as the transfer layer addresses it, and the
decode role's pulls through the KV connector (engine/kv_connector.py). A part of ``LLMEngine``
kept in its own file; it reads the engine's ``executor``, ``config`` and ``kv_connector``.
"""
from __future__ import annotations

import time

import torch

from engine.kv_layout import KVCacheLayout
from engine.outputs import KVAllocation


class EngineKVTransfer:
    """Mixed into ``LLMEngine``."""

    @property
    def kv_cache(self) -> torch.Tensor:
        """Rank 0's [num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]."""
        return self.executor.kv_cache

    def decoder_layers(self) -> list[torch.nn.Module]:
        """Rank 0's decoder layers, in order (for hooks that run between them)."""
        return list(self.executor.runner.model.model.layers)

    def kv_cache_layouts(self) -> list[KVCacheLayout]:
        """Every TP rank's cache layout, in rank order (what KV transfer addresses)."""
        return self.executor.kv_cache_layouts()

    # --- KV transfer (needs config.kv_transfer_backend) -----------------------------------
    def kv_transfer_handles(self) -> list:
        """Every TP rank's kvtransfer handle, in rank order: what a reader needs."""
        self._need_connector()
        return list(self.kv_connector.handles)

    def pull_kv(self, alloc: KVAllocation, remotes: list, remote_block_ids: list[int],
                timeout_s: float | None = None, deadline: float | None = None,
                lease_id: str | None = None):
        """Decode role: pulls the prompt KV of ``alloc`` from the remote ranks into
        ``alloc.block_ids_to_fill`` on every local rank (blocking, without the step lock: call
        it outside the step thread). Returns kvtransfer.TransferStats. On success the owner is
        told to release its lease; on failure kvtransfer.TransferError (or ValueError for bad
        input) is raised and the caller aborts the request. It ends within ``timeout_s``
        (default: kv_transfer_timeout_s) from now, and posts no read after ``deadline``
        (time.monotonic(), as the caller set it: a pull may wait for a thread first).
        ``lease_id``: the id of the owner's lease on the blocks (default: the request's)."""
        from kvtransfer.agent import check_timeout

        self._need_connector()
        timeout = self.config.kv_transfer_timeout_s if timeout_s is None else timeout_s
        check_timeout(timeout)
        end = time.monotonic() + timeout
        if deadline is not None:
            end = min(end, float(deadline))
        return self.kv_connector.pull(alloc, remotes, remote_block_ids, end, lease_id)

    def release_unread_kv(self, remotes: list, lease_id: str) -> None:
        """Decode role: tells the owner of ``remotes`` (kvtransfer.KVAgentHandle) that lease
        ``lease_id`` will not be read here, so that it may free the blocks. Blocking."""
        self._need_connector()
        self.kv_connector.release_unread(list(remotes), lease_id)

    def preconnect_kv(self, remotes: list) -> bool:
        """Decode role: connects to a prefill engine's ranks (kvtransfer.KVAgentHandle) ahead
        of the first pull from them; whether there was anything to set up. Blocking."""
        self._need_connector()
        return self.kv_connector.preconnect(remotes)

    def forget_kv_peers(self, agent_names: list[str]) -> list[str]:
        """Decode role: drops the connections to these prefill agents (their worker left for
        good); the names still in use now, to try again later. Blocking."""
        self._need_connector()
        return self.kv_connector.forget_peers(agent_names)

    def kv_peer_names(self) -> list[str]:
        """The remote KV agents this engine's rank 0 holds connections to."""
        self._need_connector()
        return self.kv_connector.peer_names()

    def kv_transfer_counters(self):
        """engine.kv_connector.KVConnectorCounters: bytes, transfers, failures, releases..."""
        self._need_connector()
        return self.kv_connector.counters()

    def _need_connector(self) -> None:
        if self.kv_connector is None:
            raise ValueError("this engine has no KV transfer backend (set kv_transfer_backend)")
