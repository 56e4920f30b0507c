"""The decode gRPC service: the engine's decode role behind DecodeWorker.

Decode allocates blocks for the prompt (reusing the prefix this worker already caches), pulls
the missing blocks from the prefill worker through kvtransfer, which also tells the prefill
worker to release its lease, then admits the request into the continuous batch and streams.
A ``local_prefill`` request skips the prefill worker: see decode_svc/local_prefill.py.
``DecodeMany`` runs the same requests, many on one stream: see decode_svc/mux.py. ``ForgetLease``
answers a router that cut a call before it could tell whether it arrived: see
decode_svc/forgotten_leases.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from decode_svc.forgotten_leases import ForgetAnswer, Reading, ReadLeases
from decode_svc.kv_sources import KVSources
from decode_svc.local_prefill import check_local_prefill_request, stream_local_prefill
from decode_svc.mux import EVENT_ROOM_BYTES, serve_decode_many
from engine.config import MAX_KV_LEASE_TIMEOUT_S
from engine.outputs import KVAllocation, RequestOutput
from engine.sampling_params import SamplingParams
from engine.worker_runtime import WorkerRuntime, abort_for, failure_marks, status_for
from kvtransfer import KVAgentHandle, TransferError
from protos import common_pb2, convert, worker_pb2, worker_pb2_grpc
from protos.limits import ENV as MAX_MESSAGE_ENV
from protos.limits import ROUTER_ROOM_BYTES, max_message_bytes
from router.ledger import TransferPulling

logger = logging.getLogger(__name__)

# A pull must end this long before the prefill lease does: the handle's lease time was measured
# on another host and crossed the network since.
LEASE_READ_MARGIN_S = 0.5


@dataclass(frozen=True)
class _CheckedDecode:
    """A Decode request's parts, each checked (INVALID_ARGUMENT otherwise)."""

    request_id: str
    prompt_ids: list[int]
    resume_ids: list[int]  # a migrated request's output so far
    params: SamplingParams
    stream_interval: int

    @classmethod
    def of(cls, request: worker_pb2.DecodeRequest) -> _CheckedDecode:
        rid = convert.check_request_id(request.request_id)
        params = convert.sampling_from_proto(request.sampling)
        ids = convert.check_prompt_token_ids(request.prompt_token_ids)
        resume = convert.check_token_ids(request.resume_token_ids, "resume")
        # 0: unset, every token; the engine refuses one past its limit (INVALID_ARGUMENT).
        return cls(rid, ids, resume, params, max(request.stream_interval, 1))


class DecodeServicer(worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, rt: WorkerRuntime) -> None:
        self.rt = rt
        # The open DecodeMany streams (decode_svc/mux.py): when the worker drains, each ends
        # once its requests are done, rather than being cut when the server stops.
        self.streams: set = set()
        rt.on_drain.append(self._drain_streams)
        # With a registry, only the KV handles prefill workers registered are read.
        self.kv_sources = KVSources(lambda: rt.registry)
        # Prefill workers' keys read ahead: a first pull from each verifies without Redis.
        rt.on_kv_source = self.kv_sources.remember
        # Room for a chunk in a message, with its request's id around it in a DecodeMany
        # batch, and with what the router adds passing it on.
        self.max_chunk_bytes = max_message_bytes() - max(EVENT_ROOM_BYTES, ROUTER_ROOM_BYTES)
        # "Will not read" notifications on their way (_tell_unread, release_unstarted).
        self._releases: set[asyncio.Future] = set()
        # The leases Decodes read here, and those the router forgot (ForgetLease).
        self.leases = ReadLeases()

    def _drain_streams(self) -> None:
        for stream in self.streams:
            stream.drain()

    async def Decode(self, request: worker_pb2.DecodeRequest, context: grpc.aio.ServicerContext):
        try:
            with self.rt.admit():
                async for chunk in self.decode(request, context.time_remaining):
                    yield chunk
        except Exception as e:  # noqa: BLE001 - every failure becomes a gRPC status
            await abort_for(context, e)

    async def DecodeMany(self, request_iterator, context):
        async for batch in serve_decode_many(self, request_iterator, context):
            yield batch

    async def decode(self, request: worker_pb2.DecodeRequest,
                     time_remaining: Callable[[], float | None]):
        """One request's chunks (both RPCs), one per ``request.stream_interval`` tokens after
        the first: the engine makes its outputs that way, so this loop wakes once a chunk, not
        once a step. ``time_remaining``: seconds left to its deadline, or None for none. The
        caller holds ``rt.admit()``."""
        req = _CheckedDecode.of(request)
        rid = req.request_id
        if request.local_prefill:
            check_local_prefill_request(request)
            chunks = stream_local_prefill(self.rt.engine, rid, req.prompt_ids, req.params,
                                          _chunk, req.resume_ids, req.stream_interval)
            async with contextlib.aclosing(chunks) as chunks:
                async for chunk in chunks:
                    self._check_size(chunk)
                    yield chunk
            return
        first = convert.check_token_ids([request.first_token_id], "first")[0]
        timings = worker_pb2.DecodeTimings()
        alloc = await self._pull_prefilled(request, req, first, time_remaining, timings)
        first_chunk = True
        try:
            chunks = self._committed(rid, alloc, timings, time.monotonic())
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    first_chunk = False
                    yield chunk
        except BaseException:
            if first_chunk:  # a commit that failed leaves the allocation: its blocks go back
                self.rt.engine.abort(rid)
            raise

    async def _pull_prefilled(self, request: worker_pb2.DecodeRequest, req: _CheckedDecode,
                              first: int, time_remaining: Callable[[], float | None],
                              timings: worker_pb2.DecodeTimings):
        """The request's allocation, its prompt's KV pulled from the prefill worker that holds
        it (``timings.kv_transfer_s``: the pull's time); whatever ends it, the lease's owner
        gets the word this worker owes it."""
        ids, resume = req.prompt_ids, req.resume_ids
        remotes = self._check_handle(request.kv_handle, len(ids) + len(resume))
        # The pull's mark and its release name the lease; a handle from before lease_id
        # existed had it under this call's id.
        lease_id = request.kv_handle.lease_id or req.request_id
        # Before the first await: a ForgetLease for the lease, answered on this loop, either
        # finds this call reading (its end tells the owner) or refuses it here. Past the pull
        # the owner has had its word, and nothing more is read.
        reading = self.leases.enter(lease_id)
        try:
            try:
                # Before NIXL parses any of it, and before a block is allocated.
                await self.kv_sources.check(request.kv_handle, ids + resume)
            except asyncio.CancelledError:
                self.release_unstarted(request)  # as a cut during the allocation, once verified
                raise
            reading.verified = True
            # On this host's clock: the handle says what was left of the lease when it was sent,
            # and when the lease ends.
            lease_left = self.kv_sources.lease_left(request.kv_handle)
            lease_ends = time.monotonic() + lease_left
            try:
                alloc = await self.rt.engine.allocate_prefilled(
                    req.request_id, ids, first, req.params, resume, req.stream_interval)
            except asyncio.CancelledError:
                # Cut before any read was posted: the router's release of the lease waits for this
                # worker's word that no read of it is in flight (the read a pull ends with says
                # so itself), else the blocks stay held until the lease expires.
                self._tell_unread(remotes, reading)
                raise
            except Exception as e:
                if _left_to_reader(e):
                    self._tell_unread(remotes, reading)
                raise
            self.rt.record_transfer(TransferPulling(request.kv_handle.worker_id, lease_id,
                                                    self.rt.worker_id, time.time(), lease_left))
            t0 = time.monotonic()
            await self._pull(alloc, remotes, list(request.kv_handle.block_ids), time_remaining(),
                             lease_ends, lease_id, reading)
            timings.kv_transfer_s = time.monotonic() - t0
            return alloc
        finally:
            # Ended before any read was posted, and asked about (ForgetLease): the router left
            # the lease to this worker's word (forgotten_leases.py).
            if reading.end() and reading.owes_word():
                self._tell_unread(remotes, reading)

    async def _committed(self, rid: str, alloc, timings: worker_pb2.DecodeTimings,
                         pulled_at: float):
        """The request's chunks once admitted into the batch, the first with its timings."""
        async with contextlib.aclosing(self.rt.engine.commit_prefilled(rid)) as outs:
            first_chunk = True
            async for out in outs:
                chunk = _chunk(out)
                if first_chunk:
                    first_chunk = False
                    now = time.monotonic()
                    sched = out.first_scheduled_time or now
                    timings.queue_s = max(sched - pulled_at, 0.0)
                    timings.first_step_s = max(now - sched, 0.0)
                    chunk.timings.CopyFrom(timings)
                    chunk.num_cached_tokens = alloc.num_cached_tokens
                self._check_size(chunk)
                yield chunk

    def _check_size(self, chunk: worker_pb2.DecodeChunk) -> None:
        """Refuses a chunk gRPC could not send (its RESOURCE_EXHAUSTED would read as a worker
        without room): only one with logprobs can come near the limit."""
        if not (chunk.prompt_logprobs or chunk.logprobs):
            return
        size = chunk.ByteSize()
        if size > self.max_chunk_bytes:
            raise ValueError(f"an output chunk would be {size} bytes, over the "
                             f"{self.max_chunk_bytes}-byte room in a message "
                             f"({MAX_MESSAGE_ENV}): ask for fewer logprobs or prompt_logprobs, "
                             f"or a smaller stream_interval")

    def _check_handle(self, h: common_pb2.KVHandle, num_tokens: int) -> list[KVAgentHandle]:
        """The handle's ranks, once it matches this worker and covers ``num_tokens`` (the
        prompt's, and a migrated request's resumed output)."""
        cfg = self.rt.config.engine
        if not h.rank_handles:
            raise ValueError("kv_handle has no rank handles")
        if not (math.isfinite(h.lease_timeout_s)
                and 0 <= h.lease_timeout_s <= MAX_KV_LEASE_TIMEOUT_S):
            # NaN or inf would lift the bound that keeps the pull inside the lease; the pull's
            # Redis record expires with the lease (a huge expiry failed its whole batch).
            raise ValueError(f"kv_handle lease_timeout_s must be a number in [0, "
                             f"{MAX_KV_LEASE_TIMEOUT_S:.0f}], got {h.lease_timeout_s}")
        if not (math.isfinite(h.lease_expires_unix_s) and h.lease_expires_unix_s >= 0):
            # A time off a prefill worker's clock, or 0 (unset): no worker made anything else.
            raise ValueError(f"kv_handle lease_expires_unix_s must be a finite number >= 0, "
                             f"got {h.lease_expires_unix_s}")
        for name in ("lease_id", "worker_id"):  # both name Redis keys
            if len(getattr(h, name)) > convert.MAX_WORKER_REQUEST_ID_CHARS:
                raise ValueError(f"kv_handle {name} is {len(getattr(h, name))} characters; at "
                                 f"most {convert.MAX_WORKER_REQUEST_ID_CHARS}")
        if h.backend != cfg.kv_transfer_backend:
            raise ValueError(f"kv_handle uses backend {h.backend!r}; this decode worker uses "
                             f"{cfg.kv_transfer_backend!r}")
        if h.block_size != cfg.block_size:
            raise ValueError(f"kv_handle block_size {h.block_size} != this worker's "
                             f"{cfg.block_size}")
        if h.num_tokens != num_tokens:
            raise ValueError(f"kv_handle holds {h.num_tokens} tokens but the request has "
                             f"{num_tokens} before its first token")
        need = -(-num_tokens // cfg.block_size)
        if len(h.block_ids) != need:
            raise ValueError(f"kv_handle has {len(h.block_ids)} block ids; "
                             f"{num_tokens} tokens need {need}")
        return [KVAgentHandle.from_bytes(b) for b in h.rank_handles]

    async def _pull(self, alloc: KVAllocation, remotes: list[KVAgentHandle],
                    remote_block_ids: list[int], remaining: float | None,
                    lease_ends: float, lease_id: str, reading: Reading) -> None:
        """Reads the prompt's KV, within the caller's deadline and before the prefill lease
        ends: a one-sided read past it would copy blocks the prefill worker may have given to
        another prompt, and this worker would decode, and cache, another prompt's KV.
        ``reading`` holds the lease until the read is over, even past a cut."""
        timeout = self.rt.config.engine.kv_transfer_timeout_s
        if remaining is not None:
            timeout = max(min(timeout, remaining), 0.001)
        lease_left = lease_ends - time.monotonic() - LEASE_READ_MARGIN_S
        if lease_left <= 0:
            self.rt.kv_failures += 1
            self.rt.engine.abort(alloc.request_id)
            raise TransferError(f"the prefill worker's lease on this KV ends in "
                                f"{lease_left + LEASE_READ_MARGIN_S:.2f} s: too soon to read it")
        # An absolute deadline: the pull may wait for an executor thread (all of them busy
        # with pulls from a stalled owner), and a timeout would start counting only then.
        deadline = time.monotonic() + min(timeout, lease_left)
        pull = asyncio.ensure_future(asyncio.to_thread(
            self.rt.llm.pull_kv, alloc, remotes, remote_block_ids, None, deadline, lease_id))
        reading.owner_told = True
        try:
            stats = await asyncio.shield(pull)
        except asyncio.CancelledError:
            # The transfer thread may still be writing into the blocks: free them only after
            # (its error, a deadline's TransferTimeout, is nobody's to raise by then).
            pull.add_done_callback(lambda f: self._abort_after_pull(f, alloc.request_id))
            reading.until(pull)
            raise
        except BaseException:
            self.rt.kv_failures += 1
            self.rt.engine.abort(alloc.request_id)
            raise
        self.rt.kv_bytes += int(getattr(stats, "num_bytes", 0))

    def release_unstarted(self, request: worker_pb2.DecodeRequest) -> None:
        """For a request cut before its pull began and before its handle was verified (a
        DecodeMany start cancelled before its task ran, a cut during the check): tells the
        owner, once the handle verifies, that its lease will not be read here."""
        if not request.local_prefill and request.HasField("kv_handle"):
            self._track_release(asyncio.ensure_future(self._release_verified(request)))

    async def _release_verified(self, request: worker_pb2.DecodeRequest) -> None:
        # Only for a handle its prefill worker signed: the notification frees whatever lease
        # it names, and a caller of this worker must not free another request's that way.
        try:
            ids = convert.check_prompt_token_ids(request.prompt_token_ids)
            resume = convert.check_token_ids(request.resume_token_ids, "resume")
            remotes = self._check_handle(request.kv_handle, len(ids) + len(resume))
            await self.kv_sources.check(request.kv_handle, ids + resume)
        except Exception:  # noqa: BLE001 - a handle no pull would have read: nothing to tell
            return
        await asyncio.to_thread(self.rt.llm.release_unread_kv, remotes,
                                request.kv_handle.lease_id or request.request_id)

    def _tell_unread(self, remotes: list[KVAgentHandle], reading: Reading) -> None:
        """Tells the owner of ``reading``'s lease that this worker will not read it."""
        reading.owner_told = True
        self._track_release(asyncio.ensure_future(asyncio.to_thread(
            self.rt.llm.release_unread_kv, remotes, reading.lease_id)))

    def _track_release(self, task: asyncio.Future) -> None:
        self._releases.add(task)
        task.add_done_callback(self._released_unread)

    def _released_unread(self, task: asyncio.Future) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # The lease then ends at its expiry, as one whose owner went away does.
            logger.warning("could not tell a prefill worker that a lease will not be read: %s",
                           task.exception())

    def _abort_after_pull(self, pull: asyncio.Future, request_id: str) -> None:
        if not pull.cancelled():
            pull.exception()  # retrieved: the caller left, so asyncio need not log it
        self.rt.engine.abort(request_id)

    async def ForgetLease(self, request: worker_pb2.ForgetLeaseRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.ForgetLeaseResponse:
        try:
            answer = self.leases.forget(request.lease_id, request.lease_timeout_s)
        except ValueError as e:
            await abort_for(context, e)
        if answer is ForgetAnswer.READING:
            self.rt.leases_forget_reading += 1
        elif answer is ForgetAnswer.NO_ROOM:
            self.rt.leases_forget_no_room += 1
        else:
            self.rt.leases_forgotten += 1
        return worker_pb2.ForgetLeaseResponse(may_be_reading=answer.may_be_reading)

    async def GetWorkerInfo(self, request, context) -> common_pb2.WorkerInfo:
        await self.rt.engine.fresh_stats()
        return self.rt.worker_info()

    async def ResetPrefixCache(self, request, context) -> common_pb2.WorkerPrefixCacheReset:
        return await self.rt.reset_prefix_cache()


def _left_to_reader(exc: Exception) -> bool:
    """Whether a decode worker that failed with ``exc`` before its pull began should tell the
    owner it will not read: the router leaves the lease to that word after an error it cannot
    place (an engine that died, an internal error). Not after one it frees the lease for
    itself (a refusal, marked) or hands the lease to another decode worker for (no room,
    RESOURCE_EXHAUSTED), where the word could free it under that worker's read; nor after
    INVALID_ARGUMENT, which a duplicate call makes: its request id is in the engine, maybe
    pulling this very lease."""
    return (status_for(exc) not in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    grpc.StatusCode.INVALID_ARGUMENT)
            and not failure_marks(exc))


def _chunk(out: RequestOutput) -> worker_pb2.DecodeChunk:
    new = out.new_token_ids
    chunk = worker_pb2.DecodeChunk(token_ids=new, text_delta=out.text_delta)
    if out.logprobs:
        chunk.logprobs.extend(convert.logprobs_to_proto(out.logprobs[len(out.logprobs) - len(new):]))
    if out.finished:
        chunk.finish_reason = out.finish_reason or ""
        stop = convert.stop_reason_to_proto(out.stop_reason)
        if stop is not None:
            chunk.stop_reason.CopyFrom(stop)
    return chunk
