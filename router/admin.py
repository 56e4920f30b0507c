"""RouterAdmin: list workers, cluster stats, drain and undrain a worker; list and cancel
the requests in flight (router/inflight.py); reset the workers' prefix caches; list the KV
held for transfers across the cluster (the transfer ledger, router/ledger.py).

Cluster stats come from the router's own view, so they answer while Redis is away; listing
and draining workers read and write the registry, so they answer UNAVAILABLE then.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from protos import common_pb2, router_pb2, router_pb2_grpc
from router.directory import WorkerDirectory, WorkerHandle
from router.errors import REGISTRY_UNREACHABLE, quoted, refuse
from router.inflight import InflightRequests
from router.ledger import DEFAULT_LIST_LIMIT, MAX_LIST_LIMIT
from router.registry import ROLES
from router.stats import RouterStats

logger = logging.getLogger(__name__)


class RouterAdminServicer(router_pb2_grpc.RouterAdminServicer):
    def __init__(self, directory: WorkerDirectory, stats: RouterStats,
                 inflight: InflightRequests) -> None:
        self.directory = directory
        self.stats = stats
        self.inflight = inflight

    async def ListWorkers(self, request, context):
        await _check_role(request.role, context)
        async with _registry(context):
            workers = await self.directory.registry.live_workers(request.role or None)
        return router_pb2.ListWorkersResponse(
            workers=workers, model_mismatch=[self.directory.model_mismatch(w) for w in workers])

    async def GetClusterStats(self, request, context):
        # The routing view itself, refreshed: the live workers of the router's model, draining
        # ones, ones taken as down and ones of another block size among them (a launcher
        # waits on these counts through drains; the router's /metrics counts them by state).
        await self.directory.refresh_if_reachable()
        workers = [w.info for w in self.directory.workers.values()]
        s = self.stats
        return router_pb2.ClusterStats(
            num_prefill_workers=sum(w.role == "prefill" for w in workers),
            num_decode_workers=sum(w.role == "decode" for w in workers),
            requests_total=s.requests_total, requests_in_flight=s.requests_in_flight,
            requests_failed=s.requests_failed, prompt_tokens_routed=s.prompt_tokens_routed,
            prefix_tokens_matched=s.prefix_tokens_matched,
            requests_prefilled_locally=s.requests_prefilled_locally,
            requests_prefilled_remotely=s.requests_prefilled_remotely,
            requests_prefilled_on_decode_cache=s.requests_prefilled_on_decode_cache,
            requests_migrated=s.requests_migrated, migrations_exhausted=s.migrations_exhausted,
            requests_rerouted=s.requests_rerouted,
            worker_hangs=self.directory.worker_hangs, decode_waits=s.decode_waits)

    async def DrainWorker(self, request, context):
        registry, wid = self.directory.registry, request.worker_id
        if not wid:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "worker_id is empty")
        changed = False
        async with _registry(context):
            # The live workers first: reading them purges a worker silent past its TTL, which a
            # drain must not land on (it would keep the flag and come back drained while the
            # admin was told NOT_FOUND).
            live = await _live(registry)
            if wid in live or request.undrain:
                # An undrain also clears the flag a worker that is gone left behind.
                changed = await registry.set_drained(wid, not request.undrain)
                live = await _live(registry)  # the reply is the state after the change
        if wid not in live and not (request.undrain and changed):
            await refuse(context, grpc.StatusCode.NOT_FOUND, f"no live worker {quoted(wid)}")
        try:
            # This router acting on it at once; its periodic refresh does it otherwise.
            await self.directory.refresh()
        except Exception as e:  # noqa: BLE001 - the change is written: answered all the same
            logger.warning("drain of %s written; this router's refresh failed (%s): it acts "
                           "on it at its next", quoted(wid), e)
        # As the routers see it now: a worker that is shutting down stays draining after an
        # undrain.
        info = live.get(wid)
        return router_pb2.DrainWorkerResponse(draining=info is not None and info.draining)

    async def ListRequests(self, request, context):
        return router_pb2.ListRequestsResponse(requests=self.inflight.list())

    async def CancelRequest(self, request, context):
        if not request.request_id:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if not self.inflight.cancel(request.request_id):
            await refuse(context, grpc.StatusCode.NOT_FOUND,
                         f"no request {quoted(request.request_id)} in flight on this router")
        return router_pb2.CancelRequestResponse()

    async def ListTransfers(self, request, context):
        if not 0 <= request.limit <= MAX_LIST_LIMIT:
            await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                         f"limit must be in [0, {MAX_LIST_LIMIT}], got {request.limit}")
        ledger = self.directory.registry.ledger
        async with _registry(context):
            entries, omitted = await ledger.entries(request.limit or DEFAULT_LIST_LIMIT)
            holders = await ledger.router_holders(e.router_id for e in entries)
        # The lease's router lives if the incarnation that took it still beats: a successor
        # under its id beats too, and may have left its predecessor's leases to expire. The
        # times are Redis's (router/ledger.py): no other host's clock is read against ours.
        return router_pb2.ListTransfersResponse(num_omitted=omitted, transfers=[
            router_pb2.TransferInfo(
                transfer_id=e.request_id, prefill_worker_id=e.prefill_worker_id,
                prefill_address=e.prefill_address, router_id=e.router_id,
                router_live=bool(e.router_incarnation)
                and holders.get(e.router_id) == e.router_incarnation, state=e.state,
                decode_worker_id=e.decode_worker_id, num_blocks=e.num_blocks,
                num_tokens=e.num_tokens, age_s=e.age_s, expires_in_s=e.expires_in_s,
                pull_s=e.pull_s)
            for e in entries])

    async def ResetPrefixCache(self, request, context):
        await _check_role(request.role, context)
        await self.directory.refresh_if_reachable()
        workers = sorted((w for w in self.directory.workers.values()
                          if (not request.role or w.info.role == request.role)
                          and (not request.worker_id or w.worker_id == request.worker_id)),
                         key=lambda w: w.worker_id)
        if request.worker_id and not workers:
            await refuse(context, grpc.StatusCode.NOT_FOUND,
                         f"no routable worker {quoted(request.worker_id)}"
                         + (f" with role {request.role}" if request.role else ""))
        done = await asyncio.gather(*(_reset_prefix_cache(w) for w in workers))
        return router_pb2.ResetPrefixCacheResponse(workers=done)


# A reset waits for the worker's running step to end: a long prefill step is seconds.
RESET_TIMEOUT_S = 30.0


async def _reset_prefix_cache(w: WorkerHandle) -> common_pb2.WorkerPrefixCacheReset:
    stub = w.prefill_stub if w.info.role == "prefill" else w.decode_stub
    try:
        return await stub.ResetPrefixCache(common_pb2.WorkerPrefixCacheResetRequest(),
                                           timeout=RESET_TIMEOUT_S)
    except grpc.aio.AioRpcError as e:
        return common_pb2.WorkerPrefixCacheReset(
            worker_id=w.worker_id, role=w.info.role,
            error=f"{e.code().name}: {e.details()}")


async def _check_role(role: str, context) -> None:
    if role and role not in ROLES:
        await refuse(context, grpc.StatusCode.INVALID_ARGUMENT,
                     f"role must be one of {ROLES} or empty, got {quoted(role)}")


async def _live(registry) -> dict[str, common_pb2.WorkerInfo]:
    return {w.worker_id: w for w in await registry.live_workers()}


@contextlib.asynccontextmanager
async def _registry(context):
    """A registry call; Redis failing becomes UNAVAILABLE rather than INTERNAL, marked as
    Redis's failure (REGISTRY_UNREACHABLE_KEY)."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - redis-py's errors, OSError, timeouts
        await refuse(context, grpc.StatusCode.UNAVAILABLE,
                     f"the worker registry (Redis) is unreachable: {type(e).__name__}: {e}",
                     REGISTRY_UNREACHABLE)
