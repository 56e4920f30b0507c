"""The Router service: validate, tokenize, pick workers, prefill, stream the first token, decode.
Short prompts under prefill-worker load, or when no prefill worker is up, may skip the prefill
worker (router/local_prefill.py): the decode worker then runs the prompt and streams every token
itself.

Cancellation and deadlines: the client's deadline bounds both legs; when the client cancels or
the deadline passes, the handler is cancelled, which cancels the Decode stream (the decode
worker aborts and frees its blocks) and releases the prefill lease.

Failures: a request whose worker answers UNAVAILABLE goes on elsewhere from the tokens already
streamed (router/migration.py); a client that lost its router sends ``resume_token_ids``, and
the request continues the same way from those.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from client.liveness import rpc_error
from engine.block_hash import hash_request_tokens
from engine.call_abort import kv_source_failed, was_refused
from engine.guide_threads import check_guide_off_loop
from engine.stray_cancels import is_stray_cancel
from protos import convert, router_pb2, router_pb2_grpc, worker_pb2
from protos.limits import max_message_bytes
from router.access_log import log_request
from router.chunks import (WholeAnswer, finish_chunk, prompt_cached_tokens,
                           record_first_decode_chunk, without_prompt_logprobs)
from router.config import RouterConfig
from router.decode_wait import DecodeWait, is_decode_full
from router.directory import NoWorkerError, WorkerDirectory, WorkerHandle, prefilling
from router.errors import (MigrationsSpent, ModelMismatch, RouterRejectError, refuse,
                           status_of)
from router.inflight import InflightRequests, OperatorCancelled, check_request_id
from router.liveness import KVSourceCut, first_while_watched, watched_stream, watched_unary
from router.migration import RequestRun, backoff_s, is_migratable, wait_to_move
from router.model_match import expected_model_mismatch
from router.parallel import check_n, fan_out, sequence_request
from router.placement import Placer
from router.prompts import ServedModel
from router.worker_handle import CountedStream
from router.write_watch import WriteWatch
from router.stats import RouterStats, SequenceEnd
from protos.stream_interval import every_n_tokens

logger = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    def __init__(self, config: RouterConfig, directory: WorkerDirectory, model: ServedModel,
                 stats: RouterStats, router_id: str = "", incarnation: str = "") -> None:
        """``router_id`` and ``incarnation`` are named in each Prefill call, for the transfer
        ledger (router/router_presence.py)."""
        self.config = config
        self.router_id, self.incarnation = router_id, incarnation
        # Set once the router stops: new requests go to another router (the SDK fails over
        # on UNAVAILABLE) while those in flight finish.
        self.draining = False
        self.model = model
        self._max_message_bytes = max_message_bytes()
        self.inflight = InflightRequests()
        self.directory = directory
        self.placer = Placer(config, directory)
        self.stats = stats
        self._ids = itertools.count()
        self._release_tasks: set[asyncio.Task] = set()
        # Requests taken before the draining check but not admitted yet (a large prompt
        # tokenizes in a thread for a while): a drain that counted only the admitted ones
        # stopped the server under them.
        self._starting = 0

    def num_inflight(self) -> int:
        """Requests the drain waits for: admitted, and taken but not admitted yet."""
        return self.stats.requests_in_flight + self._starting

    # --- RPCs -----------------------------------------------------------------------------
    async def Generate(self, request: router_pb2.GenerateRequest, context):
        writes = WriteWatch(self.config.client_write_timeout_s)
        try:
            chunks = self._generate(request, context, time.monotonic(), writes=writes)
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    await writes.write(context, chunk)
        except Exception as e:  # noqa: BLE001 - every failure becomes a gRPC status
            # After the request was closed: a client that stopped reading gets the status
            # only once it reads on, and the router holds nothing of its request meanwhile.
            await self._abort(context, e)
        finally:
            writes.stop()

    async def Complete(self, request: router_pb2.GenerateRequest, context):
        answer = WholeAnswer(self.model.identity, self._max_message_bytes)
        try:
            async for chunk in self._generate(request, context, time.monotonic(),
                                              answer.close):
                answer.add(chunk)
        except Exception as e:  # noqa: BLE001
            await self._abort(context, e)
        return answer.response

    async def _abort(self, context, e: Exception) -> None:
        await _refuse(context, e)  # counted in requests_failed by _generate

    # --- the model: tokenize, detokenize, its info ------------------------------------------
    async def Tokenize(self, request: router_pb2.TokenizeRequest, context):
        try:
            # Off the event loop when large (router/prompts.py): a 10 MB chat takes seconds.
            ids = await self.model.prompt_ids_async(request)
        except Exception as e:  # noqa: BLE001 - a gRPC status, as for Generate
            await _refuse(context, e)
        return router_pb2.TokenizeResponse(token_ids=ids,
                                           max_model_len=self.directory.max_model_len())

    async def Detokenize(self, request: router_pb2.DetokenizeRequest, context):
        try:
            return router_pb2.DetokenizeResponse(text=self.model.detokenize(request))
        except Exception as e:  # noqa: BLE001
            await _refuse(context, e)

    async def GetModelInfo(self, request, context):
        return self.model.info(self.directory.max_model_len(), self.config.block_size)

    # --- the request path -----------------------------------------------------------------
    def _resume_ids(self, request: router_pb2.GenerateRequest, params) -> list[int]:
        ids = self.model.check_vocab(convert.check_token_ids(request.resume_token_ids, "resume"),
                                     "resume")
        if ids and len(ids) >= params.max_tokens:
            raise ValueError(f"{len(ids)} resumed output tokens leave nothing to generate "
                             f"(max_tokens={params.max_tokens})")
        return ids

    def _check_expected_model(self, request: router_pb2.GenerateRequest) -> None:
        """Refuses a request that expects another model (a stream another router began)."""
        if not request.HasField("expect_model"):
            return
        # A chat with its own template: that template, which the request carries, made the
        # prompt, not the router's.
        why = expected_model_mismatch(self.model.identity, request.expect_model,
                                      request.WhichOneof("prompt") == "chat"
                                      and not request.chat.chat_template)
        if why:
            raise ModelMismatch(why)

    def _time_left(self, context, run: RequestRun) -> float | None:
        """Seconds left of the request's deadline: the client's, else --default-timeout-s from
        its arrival (once for the whole request, not again for each call or migration); None
        without either."""
        remaining = context.time_remaining()
        if remaining is None and self.config.default_timeout_s:
            remaining = run.t0 + self.config.default_timeout_s - time.monotonic()
        return remaining

    def _timeout(self, context, run: RequestRun) -> float:
        """The timeout of a call to a worker for ``run``: what is left of its deadline."""
        remaining = self._time_left(context, run)
        if remaining is None:
            remaining = self.config.prefill_timeout_s * 10
        if remaining <= 0:
            raise RouterRejectError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
        return remaining

    async def _generate(self, request: router_pb2.GenerateRequest, context, t0: float,
                        before_finish: Callable[[], None] | None = None,
                        writes: WriteWatch | None = None):
        """The request's chunks. ``before_finish``: called after the last one, before the
        request counts as finished; what it raises fails the request (Complete's answer).
        ``writes``: Generate's writes of the chunks (router/write_watch.py)."""
        rid = request.request_id or f"req-{uuid.uuid4().hex[:16]}-{next(self._ids)}"
        runs: list[RequestRun] = []
        outcome = _Outcome()
        self.stats.requests_total += 1
        self._starting += 1
        starting = True
        try:
            runs = await self._runs(request, rid, t0)
            chunks = self._chunks(rid, runs, request, context)
            # Admitted only once valid: a bad request is INVALID_ARGUMENT under any load, and
            # one the router is too full for is still logged.
            with self.stats.admit(), self.inflight.track(rid, runs, writes) as entry:
                self._starting -= 1
                starting = False
                admitted = self._admitted(chunks, runs, entry, outcome)
                async with contextlib.aclosing(admitted):
                    async for chunk in admitted:
                        yield chunk
                if before_finish is not None:
                    before_finish()
                self.stats.request_finished(
                    outcome.finish, [SequenceEnd(r.usage, len(r.emitted)) for r in runs])
        except BaseException as e:
            code, outcome.error = _failure_status(e, context, writes)
            outcome.status = code.name
            # Here, not where the status is sent: a client's deadline or cancel ends the
            # handler with a CancelledError no ``except Exception`` sees.
            self.stats.request_failed(code)
            raise
        finally:
            if starting:
                self._starting -= 1
            if self.config.log_requests:  # router/access_log.py
                log_request(rid, runs, outcome.status, outcome.error, outcome.finish)

    async def _runs(self, request: router_pb2.GenerateRequest, rid: str,
                    t0: float) -> list[RequestRun]:
        """The request's sequences, once it is found valid (raises otherwise)."""
        if self.draining:
            raise RouterRejectError(grpc.StatusCode.UNAVAILABLE,
                                    "the router is shutting down: try another router")
        check_request_id(rid)
        self._check_expected_model(request)
        client_max_tokens = request.sampling.HasField("max_tokens")
        # Filled in the request itself, so that the workers get the same values.
        convert.fill_sampling_defaults(request.sampling, self.model.sampling_defaults)
        params = convert.sampling_from_proto(request.sampling)
        params.validate_vocab(self.model.vocab_size)
        if params.has_pattern_guide:
            # Refused here, before any worker is picked; compiling a schema takes up to its
            # work budget: off the event loop, on threads of its own (engine/guide_threads.py).
            await check_guide_off_loop(params)
        resumed = self._resume_ids(request, params)
        n = check_n(request.sampling, bool(resumed))
        prompt = self.model.truncated(await self.model.prompt_ids_async(request),
                                      request.sampling, lambda: self.directory.max_model_len())
        # resumed tokens count in max_tokens (router.proto).
        wanted = len(prompt) + params.max_tokens if client_max_tokens else 0
        # Checked again per attempt, once the workers are known (0 until then).
        self.directory.check_prompt_fits(len(prompt) + len(resumed), wanted)
        if n == 1:
            return [RequestRun(rid, prompt, t0, resumed=resumed, requested_len=wanted)]
        # router/parallel.py; each sequence has its own id on the workers
        return [RequestRun(f"{rid}/{i}", prompt, t0, index=i, requested_len=wanted)
                for i in range(n)]

    def _chunks(self, rid: str, runs: list[RequestRun], request: router_pb2.GenerateRequest,
                context):
        """The chunks of every sequence of the request, merged."""
        if len(runs) == 1:
            return self._sequence(runs[0], request, context)
        return fan_out(rid, [functools.partial(
            self._sequence, run, sequence_request(request, i), context)
            for i, run in enumerate(runs)])

    async def _admitted(self, chunks, runs: list[RequestRun], entry, outcome: _Outcome):
        """The chunks of an admitted request, as the client gets them: sequence 0's finish
        reason goes in ``outcome``; an operator's cancel (RouterAdmin.CancelRequest, which set
        ``entry.cancelled``) ends them with OperatorCancelled."""
        first, timed = True, False
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    if first:
                        first = False
                        chunk.model.CopyFrom(self.model.identity)
                    if entry.cancelled:
                        # CancelRequest's cancel of this task can be lost in a Redis call
                        # (client/tasks.py); the flag it set ends the request.
                        raise asyncio.CancelledError
                    if chunk.finish_reason and chunk.index == 0:
                        outcome.finish = chunk.finish_reason
                    if not timed and chunk.index == 0:
                        # Once per request, whatever its migrations: sequence 0's first
                        # token set its ttft_s on arrival, before this chunk.
                        timed = True
                        self.stats.first_token(runs[0].timings.ttft_s)
                    entry.writing = True  # router/inflight.py: CancelRequest waits
                    yield chunk
                    entry.writing = False
                    if entry.cancelled:  # it came during the write
                        raise asyncio.CancelledError
        except asyncio.CancelledError:
            if not entry.cancelled:
                raise
            # Every leg is cancelled by now (the attempts closed); the client learns why.
            if entry.task_cancelled:
                entry.task.uncancel()
            raise OperatorCancelled() from None

    def _sequence(self, run: RequestRun, request: router_pb2.GenerateRequest, context):
        """One sequence's chunks, over as many attempts as migrations allow, a chunk per
        --stream-interval tokens."""
        chunks = self._attempts(run, request, context)
        interval = self.config.stream_interval
        return chunks if interval == 1 else every_n_tokens(chunks, interval)

    async def _attempts(self, run: RequestRun, request: router_pb2.GenerateRequest, context):
        run.usage.prompt_tokens = len(run.prompt_token_ids)
        run.usage.completion_tokens = len(run.resumed)
        while True:
            try:
                async with contextlib.aclosing(self._attempt(run, request, context)) as chunks:
                    async for chunk in chunks:
                        run.emitted.extend(chunk.token_ids)
                        self.stats.generation_tokens += len(chunk.token_ids)
                        yield chunk
                return
            except Exception as e:  # noqa: BLE001 - re-raised unless the request can move
                if not await self._migrate(run, e, context):
                    raise

    async def _migrate(self, run: RequestRun, e: Exception, context) -> bool:
        """After attempt ``e``: whether the request goes on elsewhere (router/migration.py)."""
        if not is_migratable(e) or not run.workers:
            return False
        failed = run.workers[-1]
        if kv_source_failed(e):
            # The decode worker could not read the KV: the prefill worker holding it failed
            # (one dying is still alive to a probe for a moment, and would take the
            # continuation), not the decode worker that said so.
            failed = next((w for w in run.workers if w.info.role == "prefill"), failed)
        # Not blamed, but the next attempt prefers another pair than the one that just
        # failed: a decode worker that cannot verify any prefill worker's KV (its registry
        # view lost) refuses every pull, whichever prefill worker the request moves to.
        run.avoid_next = {run.workers[-1].worker_id} - {failed.worker_id}
        remaining = self._time_left(context, run)
        if remaining is not None and remaining <= 0:
            # The deadline ended it, not the worker: UNAVAILABLE would send the client on
            # to another router with no time left (--default-timeout-s has no client deadline
            # to end the call first).
            raise RouterRejectError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    "deadline exceeded") from e
        if was_refused(e) and failed.worker_id not in run.refused_by:
            # It took none of the request (a worker that began draining, whose engine died,
            # or that exited, since the router last read the registry): going elsewhere loses
            # nothing, so it spends no migration. Once per worker: the tries stay bounded by
            # the cluster. Its probe (draining, or gone) takes it out of every request's picks
            # until the registry drops it.
            run.refused_by.add(failed.worker_id)
            run.failed.add(failed.worker_id)
            alive = await self.directory.probe(failed)
            logger.info("request %s: worker %s refused it (%s); sent elsewhere",
                        run.request_id, failed.worker_id, e.details())
            await self._pace(run, context, alive)
            run.retries += 1
            self.stats.requests_rerouted += 1
            return True
        if run.migrations >= self.config.migration_limit:
            self.stats.migrations_exhausted += 1
            raise MigrationsSpent(e) from e
        # Every worker of the attempt is asked: the one that answered UNAVAILABLE is avoided
        # by this request anyway, and any that is gone by every request.
        alive = await asyncio.gather(*(self.directory.probe(w) for w in run.workers))
        run.failed.add(failed.worker_id)
        run.failed.update(w.worker_id for w, ok in zip(run.workers, alive) if not ok)
        await self._pace(run, context, alive[run.workers.index(failed)])
        run.migrations += 1
        run.retries += 1
        self.stats.requests_migrated += 1
        logger.warning("request %s: worker %s failed (%s); continuing elsewhere after %d "
                       "tokens (migration %d of at most %d)", run.request_id, failed.worker_id,
                       e.details(), len(run.emitted), run.migrations,
                       self.config.migration_limit)
        return True

    async def _pace(self, run: RequestRun, context, blamed_alive: bool) -> None:
        """Waits before a move when the worker blamed for the failure still serves: it may
        fail the next attempt the same way (router/migration.py's pacing)."""
        base = self.config.migration_backoff_s
        if not blamed_alive or not base:
            return
        delay = backoff_s(base, run.paced)
        run.paced += 1
        logger.info("request %s: its worker still serves; next attempt in %.3f s",
                    run.request_id, delay)
        await wait_to_move(delay, self._time_left(context, run))

    async def _attempt(self, run: RequestRun, request: router_pb2.GenerateRequest, context):
        """One try at the request (or its continuation, after ``run.output_so_far``)."""
        if run.output_so_far and request.sampling.HasField("prompt_logprobs"):
            # The client has them: they came with the first token. A continuation need not
            # score the prompt again, and so may use the prefix cache.
            request = without_prompt_logprobs(request)
        ids = run.all_token_ids
        avoid = frozenset(run.failed | run.avoid_next)
        run.avoid_next = set()
        run.workers.clear()
        # The usage names this attempt's workers: a continuation the prefill finishes (its
        # last token) has no decode worker, not the failed attempt's.
        run.usage.decode_worker_id = ""
        hashes = hash_request_tokens(ids, self.config.block_size)
        where = await self.placer.place(hashes, len(ids), avoid,
                                        0 if run.started else run.requested_len)
        if not run.started and not run.retries:
            # Once per request: an attempt after a failed one (before any token) is the same
            # request's, and with n > 1 sequence 0 prefills the prompt (the others find it
            # cached).
            if run.index == 0:
                # The prompt's, as its usage counts them: a client's resumed output in ``ids``
                # was counted as output where it was made.
                prompt = len(run.prompt_token_ids)
                self.stats.routed(prompt, min(where.matched, prompt))
                self.stats.prefilled(where.local, on_decode_cache=where.held > 0)
            run.timings.router_queue_s = time.monotonic() - run.t0
        run.usage.local_prefill = where.local
        first = where.decode if where.local else where.prefill
        if where.local:
            chunks = self._local_prefill(run, request, where.decode, context)
        else:
            chunks = CountedStream(where.release_prefill, self._remote_prefill(
                run, request, where.prefill, avoid, context, where.release_prefill))
        # Held for the whole attempt: the lease release and a migration's probe use the
        # prefill worker's channel after its calls ended, the registry may drop it meanwhile.
        with self.directory.in_use(first):
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk

    async def _local_prefill(self, run: RequestRun, request, decode: WorkerHandle, context):
        """Conditional disaggregation: the decode worker runs the prompt and streams every
        token, the first included; no prefill worker, no KV transfer, no lease to release."""
        # The decode worker did the prefill, so it is named in both roles.
        run.usage.prefill_worker_id = run.usage.decode_worker_id = decode.worker_id
        dreq = worker_pb2.DecodeRequest(request_id=run.attempt_id,
                                        prompt_token_ids=run.prompt_token_ids,
                                        resume_token_ids=run.output_so_far,
                                        sampling=request.sampling, local_prefill=True,
                                        stream_interval=self.config.stream_interval)
        # Counted as prefilling on the decode worker until its first token (or failure).
        with contextlib.ExitStack() as in_prefill:
            in_prefill.enter_context(prefilling(decode))
            async with contextlib.aclosing(self._decode(dreq, decode, context, run)) as chunks:
                async for chunk in chunks:
                    in_prefill.close()
                    yield chunk

    async def _remote_prefill(self, run: RequestRun, request, prefill: WorkerHandle,
                              avoid: frozenset[str], context, counted: Callable[[], None]):
        """``counted`` ends the prefill worker's in-flight count, which its pick took."""
        resume = run.output_so_far
        rid = run.attempt_id
        presp = await self._prefill(run, rid, resume, request, prefill, context, counted)
        lease_ends = time.monotonic() + presp.kv_handle.lease_timeout_s
        first = self._prefilled_chunk(run, presp, prefill)
        if presp.finish_reason:
            yield first
            return
        done = False
        leg = _DecodeLeg()
        try:
            yield first
            dreq = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=run.prompt_token_ids,
                                            resume_token_ids=resume,
                                            first_token_id=presp.first_token_id,
                                            sampling=request.sampling, kv_handle=presp.kv_handle,
                                            stream_interval=self.config.stream_interval)
            chunks, chunk = await self._start_decode(run, dreq, prefill, avoid, context,
                                                     lease_ends, leg)
            async with contextlib.aclosing(chunks):
                while chunk is not None:
                    done = done or bool(chunk.finish_reason)
                    yield chunk
                    chunk = await anext(chunks, None)
        finally:
            if not done:
                # Cancel, deadline or failure before decode pulled the KV: free the lease now
                # rather than when it expires. Idempotent on the worker.
                self._release_later(prefill, rid, reader=leg.reader,
                                    lease=(presp.kv_handle.lease_id or rid, lease_ends))

    async def _prefill(self, run: RequestRun, rid: str, resume: list[int], request,
                       prefill: WorkerHandle, context,
                       counted: Callable[[], None]) -> worker_pb2.PrefillResponse:
        """The prefill worker's answer for attempt ``rid`` (resuming after ``resume``): the
        first token and the KV handle of its lease."""
        run.calls(prefill)
        with contextlib.ExitStack() as prefilling_call:
            prefilling_call.callback(counted)
            # Out of time before the call: nothing was sent, so nothing to release.
            timeout = min(self._timeout(context, run), self.config.prefill_timeout_s)
            try:
                return await watched_unary(prefill.calls, prefill.prefill_stub.Prefill(
                    worker_pb2.PrefillRequest(request_id=rid,
                                              prompt_token_ids=run.prompt_token_ids,
                                              resume_token_ids=resume,
                                              sampling=request.sampling,
                                              router_id=self.router_id,
                                              router_incarnation=self.incarnation),
                    timeout=timeout))
            except BaseException as e:
                if not _refused_by_worker(e):
                    # A cancel, deadline or lost call leaves it unknown whether the worker
                    # leased the prompt's KV (its answer may have been on the wire): without a
                    # release the lease would hold the blocks until it expires.
                    self._release_later(prefill, rid)
                if _past_prefill_cap(e, self._time_left(context, run)):
                    # --prefill-timeout-s ran out, not the request's deadline: the worker is
                    # stuck, which another may not be (the request moves on, as documented).
                    raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                                    f"prefill worker {prefill.worker_id} did not answer within "
                                    f"--prefill-timeout-s ({self.config.prefill_timeout_s:g} s)"
                                    ) from None
                raise

    def _prefilled_chunk(self, run: RequestRun, presp: worker_pb2.PrefillResponse,
                         prefill: WorkerHandle) -> router_pb2.GenerateChunk:
        """The chunk of the prefill's first token; the request's TTFT and usage count it."""
        timings, usage = run.timings, run.usage
        if not run.started:
            timings.prefill_queue_s = presp.timings.queue_s
            timings.prefill_compute_s = presp.timings.compute_s
            timings.ttft_s = time.monotonic() - run.t0
            usage.cached_tokens = prompt_cached_tokens(presp.num_cached_tokens, run)
        usage.completion_tokens += 1
        usage.prefill_worker_id = prefill.worker_id
        first = router_pb2.GenerateChunk(request_id=run.request_id,
                                         token_ids=[presp.first_token_id],
                                         text_delta=presp.text_delta)
        if presp.HasField("logprobs"):
            first.logprobs.append(presp.logprobs)
        first.prompt_logprobs.extend(presp.prompt_logprobs)
        if presp.finish_reason:
            finish_chunk(first, presp, run)
        return first

    async def _start_decode(self, run: RequestRun, dreq: worker_pb2.DecodeRequest,
                            prefill: WorkerHandle, avoid: frozenset[str], context,
                            lease_ends: float, leg: _DecodeLeg):
        """A prefilled request's decode leg, open and past its first chunk: (the leg's chunks,
        that chunk). A refusal for want of room is tried again, elsewhere when it can be,
        while the prefill lease keeps the KV (router/decode_wait.py). ``lease_ends``: when the
        lease ends, on this host's monotonic clock. ``leg`` says, once this returns or raises,
        which decode worker, if any, may still be reading the KV."""
        # What is left of the lease now: the first token's write to the client came between.
        wait = DecodeWait.after_prefill(self.config.decode_wait_timeout_s,
                                        max(lease_ends - time.monotonic(), 0.0),
                                        self._time_left(context, run))
        num_tokens = len(dreq.prompt_token_ids) + len(dreq.resume_token_ids) + 1
        refused: set[str] = set()
        timed = run.decode_timed
        while True:
            try:
                decode = await self.directory.pick_decode(num_tokens, avoid | refused)
            except NoWorkerError as e:
                await wait.backoff(e)
                continue
            run.usage.decode_worker_id = decode.worker_id
            opened = time.monotonic()
            # What is left of the lease now, not when the prefill answered: the decode worker
            # bounds its pull by it, so that it never reads blocks the lease no longer holds.
            dreq.kv_handle.lease_timeout_s = max(lease_ends - time.monotonic(), 0.0)
            chunks = self._decode(dreq, decode, context, run)
            leg.reader = decode
            try:
                # Until its first chunk the decode worker is pulling the KV from the prefill
                # worker, which is health-checked meanwhile: a hung one fails the leg at once.
                with self.directory.watched(prefill):
                    chunk = await first_while_watched(prefill.calls, chunks)
            except Exception as e:  # noqa: BLE001 - re-raised unless the worker was full
                await chunks.aclose()
                # The worker's own word that its pull never began (a refusal, no room) or has
                # ended (it commits nothing it failed to read); any other end (a cut, this
                # router's for a hung source too, a lost call) leaves it unknown whether a
                # read, and the commit after it, is to come.
                if not isinstance(e, KVSourceCut) and (
                        was_refused(e) or kv_source_failed(e) or is_decode_full(e)):
                    leg.reader = None
                await wait.backoff(e)
                run.workers.remove(decode)  # a refusal for room is no failure of the worker's
                refused.add(decode.worker_id)
                continue
            except BaseException:
                await chunks.aclose()
                raise
            leg.reader = None  # a first chunk comes after the pull, never during it
            if wait.retries:
                self.stats.decode_waits += 1
                if not timed and run.decode_timed:  # this leg's queue began at the refusal
                    # (its own pull, queue and first step the worker timed itself)
                    run.timings.decode_queue_s += opened - wait.started
            return chunks, chunk

    def _decode(self, dreq: worker_pb2.DecodeRequest, decode: WorkerHandle, context,
                run: RequestRun) -> CountedStream:
        """The decode leg's chunks, counted in flight on ``decode`` from now: the next request
        picking a decode worker sees this one (router/worker_handle.py)."""
        return CountedStream(self.directory.hold_inflight(decode),
                             self._decode_chunks(dreq, decode, context, run))

    async def _decode_chunks(self, dreq: worker_pb2.DecodeRequest, decode: WorkerHandle,
                             context, run: RequestRun):
        run.calls(decode)
        timeout = self._timeout(context, run)
        if self.config.decode_stream == "multiplexed":
            chunks = decode.mux.decode(dreq, timeout)
        else:
            # A Decode call of its own; leaving early cancels it.
            chunks = watched_stream(decode.calls, decode.decode_stub.Decode(dreq, timeout=timeout))
        # Leaving early (cancel, deadline, a failed client write) cancels the request on the
        # decode worker, which aborts it and frees its blocks.
        async with contextlib.aclosing(chunks):
            first = True
            async for d in chunks:
                if first:
                    first = False
                    record_first_decode_chunk(d, dreq.local_prefill, run)
                run.usage.completion_tokens += len(d.token_ids)
                self.stats.decode_chunks_received += 1
                chunk = router_pb2.GenerateChunk(request_id=run.request_id,
                                                 token_ids=d.token_ids,
                                                 text_delta=d.text_delta, logprobs=d.logprobs,
                                                 prompt_logprobs=d.prompt_logprobs)
                if d.finish_reason:
                    finish_chunk(chunk, d, run)
                    yield chunk
                    # Done: what the call ends with changes nothing now. Read on, a failure
                    # (a health-check cut, the worker lost) would move a finished request,
                    # which would generate past its end.
                    return
                yield chunk
        # Ended OK before its final chunk: the worker failed somehow, and the request is not
        # done. Moved on like a lost worker's, not closed OK to the client with part of it.
        raise rpc_error(grpc.StatusCode.UNAVAILABLE,
                        f"decode worker {decode.worker_id} ended the request's stream without "
                        "a finish reason")

    def _release_later(self, prefill: WorkerHandle, rid: str, reader: WorkerHandle | None = None,
                       lease: tuple[str, float] = ("", 0.0)) -> None:
        """``reader``: a decode worker given the lease's handle that may still read its blocks
        (and commit what it read: the cut reaches it on another connection, maybe after its
        pull ended), so the prefill worker must not reuse them before that read is over,
        unless ``reader`` says no read of it was or will be posted there (``lease``: its id,
        and when it ends on this host's monotonic clock)."""
        async def release() -> None:
            may_be_read = reader is not None and await self._may_be_read(reader, *lease)
            req = worker_pb2.ReleaseKVRequest(request_id=rid, may_be_read=may_be_read)
            with self.directory.in_use(prefill), \
                    contextlib.suppress(grpc.aio.AioRpcError, asyncio.TimeoutError):
                await prefill.prefill_stub.ReleaseKV(req, timeout=5.0)

        task = asyncio.get_running_loop().create_task(release())
        self._release_tasks.add(task)
        task.add_done_callback(self._release_tasks.discard)

    async def _may_be_read(self, reader: WorkerHandle, lease_id: str, lease_ends: float) -> bool:
        """Whether ``reader`` may be reading the lease, by its own word (ForgetLease): a Decode
        call cut before its first chunk may or may not have reached it, and gRPC does not say.
        Told no, it refuses any Decode with the lease still to come. Without an answer, a read
        may be under way."""
        req = worker_pb2.ForgetLeaseRequest(lease_id=lease_id,
                                            lease_timeout_s=max(lease_ends - time.monotonic(), 0.0))
        try:
            with self.directory.in_use(reader):
                answer = await reader.decode_stub.ForgetLease(req, timeout=5.0)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.TimeoutError):
            return True  # its channel closed (the worker left the registry) included
        return answer.may_be_reading


@dataclass
class _DecodeLeg:
    """A prefilled request's decode legs, as the release of its lease needs them."""

    # The decode worker of the last call given the lease's handle while that call may be
    # reading it: not answered with a first chunk nor with "not reading". Only a refusal for
    # room tries another worker, and a refused call reads nothing, so one worker is enough.
    reader: WorkerHandle | None = None


_DEADLINE_SLACK_S = 0.05


@dataclass
class _Outcome:
    """How a request ended, for the access log."""

    status: str = "OK"
    error: str = ""
    finish: str = ""  # sequence 0's finish reason


def _failure_status(e: BaseException, context,
                    writes: WriteWatch | None) -> tuple[grpc.StatusCode, str]:
    """The status a request that failed with ``e`` ends with."""
    if writes is not None and writes.cut is not None:
        # Closed as its write was given up: the client stopped reading, or an operator's
        # cancel found the write stuck.
        return status_of(writes.cut)
    code, error = status_of(e)
    if code == grpc.StatusCode.CANCELLED and _past_deadline(context):
        # gRPC cancels the handler at the client's deadline: that is what ended it (and what
        # the client got), not a cancel.
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded"
    if isinstance(e, asyncio.CancelledError) and is_stray_cancel(context, e):
        # Nobody cancelled the call: engine/stray_cancels.py ends it INTERNAL.
        return grpc.StatusCode.INTERNAL, "the router cancelled its own handler"
    return code, error


def _past_deadline(context) -> bool:
    remaining = context.time_remaining() if context is not None else None
    # gRPC's cancel at the deadline can be seen a moment before its clock reads it as passed.
    return remaining is not None and remaining <= _DEADLINE_SLACK_S


# Statuses a worker answers a request it did not take with: no lease can exist.
_REFUSALS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})


def _past_prefill_cap(e: BaseException, time_left: float | None) -> bool:
    """Whether a Prefill call ended at the router's cap on it while the request had time."""
    return (isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            and (time_left is None or time_left > 0))


def _refused_by_worker(e: BaseException) -> bool:
    return (isinstance(e, grpc.aio.AioRpcError) and e.code() in _REFUSALS) or was_refused(e)


async def _refuse(context, e: Exception) -> None:
    """Ends the call with e's gRPC status: never a raw traceback to the caller, nor a message
    too long for the status's header (router/errors.py)."""
    code, msg = status_of(e)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("router internal error", exc_info=e)
    mark = getattr(e, "mark", None)  # what the SDK reads for its next attempt
    await refuse(context, code, msg, ((mark, "1"),) if mark else ())
