"""Which KV handles a decode worker reads from: with a registry, only those their prefill
worker registered.

A NIXL handle carries its agent's metadata, which UCX parses in this process the first time
the agent is met, and UCX checks it with assertions: a corrupted blob aborts the whole process
(measured with random byte changes: one blob in 70 to 260 failed UCX's address-version
assertion, SIGABRT), failing every request on the worker for one bad call. Prefill workers
write their handles to the registry before their first heartbeat makes them routable
(router/presence.py), so a handle that is not byte for byte one of those came from no prefill
worker of this cluster: it is refused before anything parses it. A worker without a registry
(driven directly) reads what it is given, as a Redis that does not answer leaves it to.

A refused handle is its source's failure (PeerGoneError: UNAVAILABLE, the request is prefilled
again elsewhere), not the caller's bad input. The usual one is stale: a prefill worker given
its --worker-id keeps it across a restart and registers its new agents' handles, so a handle
given out before the restart differs from them, and its KV is gone (the torch backend's new
owner refuses such a handle as well). A corrupted one, far rarer, costs a router one more
prefill within the request's migration limit.
"""
from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Callable

from kvtransfer import PeerGoneError
from protos import common_pb2
from router.errors import quoted

logger = logging.getLogger(__name__)

# Handles found registered, remembered so that a pull asks Redis once per prefill worker start.
MAX_REMEMBERED = 256
# How long a pull waits for the registry's answer before reading the handle unchecked.
REGISTRY_WAIT_S = 1.0


class KVSources:
    def __init__(self, registry: Callable[[], object | None]) -> None:
        self._registry = registry  # router.registry.Registry, or None without Redis
        self._registered: OrderedDict[tuple[bytes, ...], None] = OrderedDict()

    async def check(self, h: common_pb2.KVHandle) -> None:
        """Raises PeerGoneError (UNAVAILABLE: the request moves) for a NIXL handle that is not
        one its prefill worker registered: it registered other handles, or none."""
        if h.backend != "nixl":
            return
        blobs = tuple(h.rank_handles)
        if blobs in self._registered:
            return
        registry = self._registry()
        if registry is None:
            return
        try:
            async with asyncio.timeout(REGISTRY_WAIT_S):
                registered = tuple(await registry.kv_handles(h.worker_id))
        except Exception as e:  # noqa: BLE001 - Redis away: read the handle, as without one
            logger.warning("could not check a KV handle of prefill worker %s in the registry "
                           "(%s): read as given", quoted(h.worker_id), str(e) or type(e).__name__)
            return
        if not registered:
            raise PeerGoneError(f"prefill worker {quoted(h.worker_id)} has no KV handles in the "
                                "registry: its KV is not read")
        if registered != blobs:
            raise PeerGoneError(f"kv_handle differs from the KV handles prefill worker "
                                f"{quoted(h.worker_id)} registered (a stale handle, from "
                                "before the worker restarted?): its KV is not read")
        self._registered[blobs] = None
        if len(self._registered) > MAX_REMEMBERED:
            self._registered.popitem(last=False)
