"""The prefill gRPC service: the engine's prefill role behind PrefillWorker.

Prefill runs the prompt (chunked, sharing cached prefix blocks), samples the first token and
answers with it and a KV handle; the prompt's blocks stay leased until ReleaseKV, the decode
worker's release notification, or the lease's expiry. A ReleaseKV that says a decode worker may
still be reading them (``may_be_read``) leaves them to the latter two.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from dataclasses import dataclass

import grpc

from engine.call_abort import abort_call
from engine.outputs import KVLease
from engine.worker_runtime import WorkerRuntime, abort_for
from kvtransfer import handle_mac
from protos import common_pb2, convert, worker_pb2, worker_pb2_grpc
from protos.limits import ENV as MAX_MESSAGE_ENV
from protos.limits import ROUTER_ROOM_BYTES, max_message_bytes
from router.ledger import TransferOpened
from router.router_presence import check_incarnation, check_router_id

_MAX_REMEMBERED_IDS = 1024


@dataclass(frozen=True)
class _Held:
    deadline: float  # the lease's, time.monotonic()
    opened: TransferOpened  # its transfer-ledger entry, as opened


class PrefillServicer(worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        # What gRPC would refuse to send (its error would read as a refusal to the router,
        # which then releases nothing), less what the router adds passing it on: an answer
        # over it is refused here, its lease freed.
        self.max_answer_bytes = max_message_bytes() - ROUTER_ROOM_BYTES
        # request id -> the lease held, to answer ReleaseKV truthfully and to put the ledger
        # right (the worker's republish: Redis lost entries, or kept closed ones): dropped as
        # the engine ends each lease (a reader's release, expiry), and pruned past its
        # deadline.
        self._leases: dict[str, _Held] = {}
        rt.on_lease_ended = self._lease_ended
        rt.held_transfers = self._held_transfers
        # Ids of the Prefill calls running here, and those of them a ReleaseKV came for
        # before their lease existed (see _prefill): as many as calls run, never evicted.
        self._prefilling: set[str] = set()
        self._released_early: set[str] = set()
        # Ids released before their Prefill call began here (a release can overtake its
        # call), oldest first: bounded, since most such ids never come.
        self._released_unseen: dict[str, bool] = {}
        # Ids whose lease the engine ended lately: a ReleaseKV for one is answered, not
        # mistaken for one that came before its lease.
        self._ended: dict[str, bool] = {}
        # Router releases left to the lease's reader (ReleaseKV's may_be_read).
        self.num_releases_deferred = 0

    async def Prefill(self, request: worker_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.PrefillResponse:
        try:
            with self.rt.admit():
                resp = await self._prefill(request)
        except Exception as e:  # noqa: BLE001 - every failure becomes a gRPC status
            await abort_for(context, e)
        if resp is None:
            await abort_call(context, grpc.StatusCode.CANCELLED, "the request's KV was released "
                             "(ReleaseKV) before its prefill ended")
        return resp

    async def _prefill(self, request: worker_pb2.PrefillRequest
                       ) -> worker_pb2.PrefillResponse | None:
        """The answer; None when a ReleaseKV for the request came first (its lease, made
        since, is released at once)."""
        rid = convert.check_request_id(request.request_id) if request.request_id \
            else f"prefill-{uuid.uuid4().hex}"
        mine = rid not in self._prefilling  # else the engine refuses this second call
        self._prefilling.add(rid)
        if self._released_unseen.pop(rid, False):
            self._released_early.add(rid)
        try:
            return await self._run_prefill(rid, request)
        finally:
            if mine:
                self._prefilling.discard(rid)
                self._released_early.discard(rid)

    async def _run_prefill(self, rid: str, request: worker_pb2.PrefillRequest
                           ) -> worker_pb2.PrefillResponse | None:
        params = convert.sampling_from_proto(request.sampling)
        ids = convert.check_prompt_token_ids(request.prompt_token_ids)
        resume = convert.check_token_ids(request.resume_token_ids, "resume")
        check_router_id(request.router_id)
        check_incarnation(request.router_incarnation)
        async with contextlib.aclosing(self.rt.engine.generate(rid, ids, params, resume)) as outs:
            async for out in outs:
                first_token_time = time.monotonic()
                break
            else:  # pragma: no cover - the engine always answers or raises
                raise RuntimeError(f"request {rid} produced no output")
        sched = out.first_scheduled_time or first_token_time
        resp = worker_pb2.PrefillResponse(
            first_token_id=out.new_token_ids[0], text_delta=out.text_delta,
            logprobs=(convert.logprobs_to_proto(out.logprobs) or [None])[0],
            num_cached_tokens=out.num_cached_tokens,
            prompt_logprobs=convert.prompt_logprobs_to_proto(out.prompt_logprobs),
            timings=worker_pb2.PrefillTimings(queue_s=max(sched - out.arrival_time, 0.0),
                                              compute_s=max(first_token_time - sched, 0.0)))
        if out.finished:
            resp.finish_reason = out.finish_reason or ""
            stop = convert.stop_reason_to_proto(out.stop_reason)
            if stop is not None:
                resp.stop_reason.CopyFrom(stop)
            self._check_size(resp, request)
            return resp
        lease = out.kv_lease
        if rid in self._released_early:
            # The router cut the call and released before the lease existed, so that
            # release found nothing: this one frees it (it is never listed in the ledger).
            self.rt.engine.release_kv(rid)
            return None
        lease_left = max(lease.expires_at - time.monotonic(), 0.0)
        resp.kv_handle.CopyFrom(common_pb2.KVHandle(
            worker_id=self.rt.worker_id, worker_address=self.rt.address,
            backend=self.rt.config.engine.kv_transfer_backend, rank_handles=self.rt.kv_handle_bytes,
            block_ids=lease.block_ids, num_tokens=lease.num_tokens, block_size=lease.block_size,
            lease_timeout_s=lease_left, lease_id=rid,
            lease_expires_unix_s=time.time() + lease_left))
        # A decode worker reads it only as signed: these blocks, for these tokens' KV, until
        # the lease ends.
        resp.kv_handle.mac = handle_mac.sign(self.rt.kv_mac_key, resp.kv_handle, ids + resume)
        try:
            self._check_size(resp, request)
        except ValueError:
            self.rt.engine.release_kv(rid)
            raise
        self._prune()
        opened = self._opened(request, lease)
        self._leases[rid] = _Held(lease.expires_at, opened)
        # Its close (``LeaseEnded``) comes from the engine thread when the lease ends, after
        # this: the reader's pull and the expiry come later, and a ReleaseKV that came sooner
        # was handled above.
        self.rt.record_transfer(opened)
        return resp

    def _check_size(self, resp: worker_pb2.PrefillResponse,
                    request: worker_pb2.PrefillRequest) -> None:
        size = resp.ByteSize()
        if size > self.max_answer_bytes:
            raise ValueError(
                f"the prefill answer would be {size} bytes, over the {self.max_answer_bytes} "
                f"bytes it may take of the message limit ({MAX_MESSAGE_ENV}): prompt_logprobs="
                f"{request.sampling.prompt_logprobs} for {len(request.prompt_token_ids)} prompt "
                f"tokens; ask for fewer")

    def _opened(self, request: worker_pb2.PrefillRequest, lease: KVLease) -> TransferOpened:
        """The lease's transfer-ledger entry."""
        now_wall, now = time.time(), time.monotonic()
        return TransferOpened(
            request_id=lease.request_id, router_id=request.router_id,
            router_incarnation=request.router_incarnation, prefill_address=self.rt.address,
            num_blocks=len(lease.block_ids), num_tokens=lease.num_tokens, leased_at=now_wall,
            expires_at=now_wall + max(lease.expires_at - now, 0.0))

    def _held_transfers(self) -> list[TransferOpened]:
        """The ledger entries of the leases held now, each with what is left of it."""
        now = time.monotonic()
        return [dataclasses.replace(h.opened, remaining_s=h.deadline - now)
                for h in self._leases.values() if h.deadline > now]

    def _lease_ended(self, request_id: str) -> None:
        self._leases.pop(request_id, None)
        _remember(self._ended, request_id)

    async def ReleaseKV(self, request: worker_pb2.ReleaseKVRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.ReleaseKVResponse:
        try:
            convert.check_request_id(request.request_id)
        except ValueError as e:
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.may_be_read and request.request_id in self._leases:
            # A decode worker may be reading these blocks, and commits what it read unless
            # the router's cancel reaches it first: freed now, they could be given to another
            # prompt and overwritten under that read, and the reader would cache that KV under
            # this prompt's hashes. Its own release (sent once its read ended) or the lease's
            # expiry (past which it posts no read) frees them.
            self.num_releases_deferred += 1
            return worker_pb2.ReleaseKVResponse(released=False)
        held = self._leases.pop(request.request_id, None)
        if held is None and self._ended.pop(request.request_id, None) is None:
            if request.request_id in self._prefilling:
                self._released_early.add(request.request_id)
            else:
                _remember(self._released_unseen, request.request_id)
        self.rt.engine.release_kv(request.request_id)  # idempotent in the engine
        # True only for a lease this call ended: one a reader's pull released, or that
        # expired, was not held any more (as of the engine's events, which reach the loop
        # after its next step: an idle one ticks every 0.2 s).
        return worker_pb2.ReleaseKVResponse(released=held is not None
                                            and held.deadline > time.monotonic())

    async def GetWorkerInfo(self, request, context) -> common_pb2.WorkerInfo:
        await self.rt.engine.fresh_stats()
        return self.rt.worker_info()

    async def ResetPrefixCache(self, request, context) -> common_pb2.WorkerPrefixCacheReset:
        return await self.rt.reset_prefix_cache()

    def _prune(self) -> None:
        now = time.monotonic()
        if len(self._leases) > 1024:
            for rid in [r for r, h in self._leases.items() if h.deadline <= now]:
                del self._leases[rid]


def _remember(ids: dict[str, bool], request_id: str) -> None:
    """Adds ``request_id`` to a bounded record of ids, oldest dropped first."""
    ids[request_id] = True
    while len(ids) > _MAX_REMEMBERED_IDS:
        del ids[next(iter(ids))]
