"""Workers that failed: a probe after a failed request, and the liveness checks' cut of a
hung worker. Either marks the worker down: no requests until the registry would have dropped
it (the heartbeat TTL) or it registers at another address. A migrating request also prefers
workers other than the ones that failed it (router/migration.py)."""
from __future__ import annotations

import asyncio
import logging
import time

import grpc

from protos import common_pb2
from router.worker_handle import WorkerHandle

logger = logging.getLogger(__name__)

# A worker that failed a request must answer a probe within this to keep receiving requests.
PROBE_TIMEOUT_S = 1.0


class WorkerFailures:
    """WorkerDirectory's down marks (``_down``) and probes (``_probes``)."""

    def is_down(self, w: WorkerHandle) -> bool:
        """Failed its last probe, and has not registered anew (another address) since. While
        Redis fails, the registry cannot drop a dead worker, so the mark does not expire."""
        mark = self._down.get(w.worker_id)
        if mark is None:
            return False
        address, until = mark
        if address != w.info.address or (time.monotonic() >= until and self.registry_ok):
            del self._down[w.worker_id]
            return False
        return True

    async def probe(self, w: WorkerHandle) -> bool:
        """After ``w`` failed a request: whether it still serves. One that does not answer in
        time, or is draining, takes no requests until the registry drops it or it restarts."""
        # One probe per incarnation: a worker registered anew at another address while its
        # old one's probe hangs is asked itself, not judged by its predecessor's answer.
        key = (w.worker_id, w.info.address)
        probe = self._probes.get(key)
        if probe is None:
            probe = self._probes[key] = asyncio.ensure_future(self._probe(w))
            probe.add_done_callback(lambda _: self._probes.pop(key, None))
        return await asyncio.shield(probe)

    async def _probe(self, w: WorkerHandle) -> bool:
        stub = w.prefill_stub if w.info.role == "prefill" else w.decode_stub
        try:
            info = await stub.GetWorkerInfo(common_pb2.WorkerInfoRequest(),
                                            timeout=PROBE_TIMEOUT_S)
            alive = info.worker_id == w.worker_id and not info.draining
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # UsageError: channel retired
            alive = False
        if not alive:
            logger.warning("worker %s (%s) stops receiving requests: it failed a request and "
                           "its probe", w.worker_id, w.info.address)
            self._mark_down(w)
        return alive

    def _hung(self, w: WorkerHandle, reason: str) -> None:
        """A worker with calls on it stopped answering health checks: its calls fail with
        UNAVAILABLE (and migrate), and it takes no requests until the registry drops it or it
        registers anew."""
        n = w.calls.cut_all(f"worker {w.worker_id} ({w.info.address}) hung: {reason}")
        logger.warning("worker %s (%s) hung (%s): %d call(s) on it cut, and it stops "
                       "receiving requests", w.worker_id, w.info.address, reason, n)
        self._mark_down(w)
        self.worker_hangs += 1

    def _mark_down(self, w: WorkerHandle) -> None:
        """No requests for ``w`` until the registry would have dropped it, or it registers at
        another address (is_down)."""
        self._down[w.worker_id] = (w.info.address, time.monotonic() + self.registry.ttl_s)
