"""The engine's side of KV transfer: its ranks' handles, pulls into its blocks, and releases.

Prefill role: every rank's cache is served by its rank's agent; release notifications that
readers attach to their pulls arrive at rank 0's agent and free the request's lease at once.
Decode role: ``pull`` writes a remote prompt's blocks into the blocks the engine allocated.
"""
from __future__ import annotations

import logging
import threading

from engine.outputs import KVAllocation

logger = logging.getLogger(__name__)

RELEASE_PREFIX = b"release:"
_POLL_S = 0.005


class KVConnector:
    def __init__(self, engine) -> None:
        self.engine = engine
        self.agent = engine.executor.kv_agent
        self.handles = engine.executor.kv_handles()
        self.num_released = 0
        self._stop = threading.Event()
        self._poller = threading.Thread(target=self._poll_releases, name="pdserve-kv-release",
                                        daemon=True)
        self._poller.start()

    def pull(self, alloc: KVAllocation, remotes: list, remote_block_ids: list[int],
             timeout_s: float):
        """Fills ``alloc.block_ids_to_fill`` from the matching tail of ``remote_block_ids``;
        then tells the owner to release its lease."""
        if self.engine.config.tensor_parallel_size != 1:
            # Decode ranks 1.. would have to pull in their own processes: not built yet.
            raise ValueError("a decode engine with tensor_parallel_size > 1 cannot pull KV yet")
        n = alloc.num_cached_blocks
        if len(remote_block_ids) != len(alloc.block_ids):
            raise ValueError(f"the remote holds {len(remote_block_ids)} blocks; the request "
                             f"needs {len(alloc.block_ids)}")
        notify = RELEASE_PREFIX + alloc.request_id.encode()
        return self.agent.pull(remotes, list(remote_block_ids[n:]), alloc.block_ids_to_fill,
                               timeout_s, notify=notify)

    def _poll_releases(self) -> None:
        while not self._stop.wait(_POLL_S):
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

    def close(self) -> None:
        self._stop.set()
        self._poller.join(timeout=5)
