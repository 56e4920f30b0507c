"""``DecodeMany``: many decode requests on one bidirectional stream.

The router keeps one such stream open per decode worker. Starting a request is one message on
it, cancelling one another; the outputs of an engine step, for every request on the stream,
leave as one ``DecodeBatch``. With a ``Decode`` call per request the worker sends a gRPC
message per token per request: at batch 32 that is 32 messages a step, each paid for on this
worker's event loop (and, through the GIL, by its engine thread) and again on the router.

Each request runs exactly as a ``Decode`` call does (``DecodeServicer.decode``): the same
admission, validation, KV pull, deadline and abort when it is left early, and it fails alone,
with the status its ``Decode`` call would have ended with. The stream ends (OK) once the caller has
closed its side, or this worker drains, and every request on it is done; when the stream is
cancelled (the caller went away, or the server's stop grace ran out) every request on it is
aborted and its blocks freed.

A caller that hangs with the stream open (a stopped router, a host gone without closing its
connection) would leave its requests decoding for nobody until they finish: gRPC's buffers take
minutes of tokens before a write blocks. So a caller that sends heartbeats (the router does,
every --health-check-interval-s) is watched: after ``misses`` intervals without a control
message past the one the next heartbeat was due in, every request on the stream is aborted and
the stream ends.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import math
from collections.abc import AsyncIterator

from engine.call_abort import KV_SOURCE_FAILED_KEY, REFUSED_KEY
from engine.worker_runtime import failure_marks, status_and_message
from protos import convert, worker_pb2
from protos.limits import max_message_bytes

logger = logging.getLogger(__name__)

# At most this many events per DecodeBatch (a chunk with 20 top logprobs per token is ~1 KB).
MAX_EVENTS_PER_BATCH = 1024
# A batch's framing beside its events' own bytes: each event's field tag and length.
_EVENT_FRAMING_BYTES = 8
# What a chunk's event adds to it in a batch, at most: the request's id (UTF-8, up to 4 bytes
# a character), its tag and length, and the chunk's and the event's framing.
EVENT_ROOM_BYTES = 4 * convert.MAX_WORKER_REQUEST_ID_CHARS + 32


async def serve_decode_many(servicer, request_iterator,
                            context) -> AsyncIterator[worker_pb2.DecodeBatch]:
    """The body of ``DecodeWorker.DecodeMany`` for ``servicer`` (a ``DecodeServicer``)."""
    mux = _DecodeMux(servicer)
    mux.draining = servicer.rt.draining  # opened during a drain: ends once idle
    servicer.streams.add(mux)
    reader = asyncio.create_task(mux.read(request_iterator))
    watch = asyncio.create_task(mux.watch_caller())
    try:
        async for batch in mux.batches():
            yield batch
    finally:
        servicer.streams.discard(mux)
        reader.cancel()
        watch.cancel()
        mux.cancel_all()


class _DecodeMux:
    def __init__(self, servicer) -> None:
        self.servicer = servicer
        self.tasks: dict[str, asyncio.Task] = {}
        # The starts whose task has not run yet (a cancel may come before it does).
        self.unstarted: dict[str, worker_pb2.DecodeRequest] = {}
        # Events not sent yet: the writer takes the whole batch each time it wakes, so every
        # request a step woke lands in one message.
        self.pending = worker_pb2.DecodeBatch()
        self.ready = asyncio.Event()
        self.reading = True
        # The worker is draining: the stream ends (OK) once its requests are done. Starts that
        # still arrive are refused UNAVAILABLE by admission, so the caller moves them on.
        self.draining = False
        # The caller's heartbeat (interval_s, misses) once it sent one; when it last spoke.
        self.heartbeat: worker_pb2.DecodeHeartbeat | None = None
        self.heard = asyncio.get_running_loop().time()
        self._heard_first = asyncio.Event()

    # --- the caller's side ----------------------------------------------------------------
    async def read(self, request_iterator) -> None:
        try:
            async for ctl in request_iterator:
                self.heard = asyncio.get_running_loop().time()
                kind = ctl.WhichOneof("kind")
                if kind == "heartbeat":
                    self._heartbeat(ctl.heartbeat)
                elif kind == "start":
                    self._start(ctl.start)
                elif kind == "cancel":
                    task = self.tasks.get(ctl.cancel)
                    if task is not None:
                        task.cancel()
        finally:
            self.reading = False
            self.ready.set()

    def _heartbeat(self, hb: worker_pb2.DecodeHeartbeat) -> None:
        if not (math.isfinite(hb.interval_s) and 0.01 <= hb.interval_s <= 3600
                and 1 <= hb.misses <= 100):
            return  # not a promise this worker can hold the caller to: not watched
        self.heartbeat = hb
        self._heard_first.set()

    async def watch_caller(self) -> None:
        """Ends the stream, its requests aborted, once a caller that sends heartbeats has been
        silent for ``misses`` intervals past the one its next heartbeat is due in: a caller
        that beats every interval is silent for up to one interval at any time, so with
        ``misses`` 1 a live router's stream was cut within a few intervals.

        A check that wakes late (this worker's own loop stalled: a starved process) judges
        nothing: the caller's heartbeats may be waiting, unread, behind it, and the reader gets
        one interval to take them first."""
        await self._heard_first.wait()
        loop = asyncio.get_running_loop()
        stalled = False
        while self.reading:
            interval = self.heartbeat.interval_s
            limit = interval * (self.heartbeat.misses + 1)
            silent = loop.time() - self.heard
            if silent >= limit and not stalled:
                logger.warning("DecodeMany caller silent for %.1f s (heartbeats every %g s): "
                               "taken as hung; its %d request(s) are aborted", silent,
                               interval, len(self.tasks))
                self.cancel_all()
                self.reading = False
                self.ready.set()
                return
            delay = limit - silent if silent < limit else interval
            wake = loop.time() + delay
            await asyncio.sleep(delay)
            stalled = loop.time() - wake > interval

    def _start(self, start: worker_pb2.DecodeStart) -> None:
        rid = start.request.request_id
        if not rid:
            self._fail(rid, ValueError("request_id is empty"))
        elif len(rid) > convert.MAX_WORKER_REQUEST_ID_CHARS:
            # Refused: every event of the request would carry it (this one echoes it once).
            self._fail(rid, ValueError(f"request_id is {len(rid)} characters; at most "
                                            f"{convert.MAX_WORKER_REQUEST_ID_CHARS}"))
        elif rid in self.tasks:
            self._fail(rid, ValueError(f"request {rid} is already running on this stream"))
        elif not math.isfinite(start.timeout_s) or start.timeout_s < 0:
            self._fail(rid, ValueError(f"timeout_s must be a finite number >= 0 (0: none), "
                                       f"got {start.timeout_s}"))
        else:
            task = asyncio.create_task(self._run(rid, start))
            self.tasks[rid] = task
            if start.request.HasField("kv_handle") and not start.request.local_prefill:
                self.unstarted[rid] = start.request
            # Not in _run's finally: a task cancelled before its first step (a cancel read
            # right after its start) never enters _run, and would stay listed, holding the
            # stream open after the caller half-closed it.
            task.add_done_callback(functools.partial(self._done, rid))

    async def _run(self, rid: str, start: worker_pb2.DecodeStart) -> None:
        self.unstarted.pop(rid, None)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + start.timeout_s if start.timeout_s > 0 else None

        def time_remaining() -> float | None:
            return None if deadline is None else deadline - loop.time()

        try:
            async with asyncio.timeout_at(deadline):
                with self.servicer.rt.admit():
                    async for chunk in self.servicer.decode(start.request, time_remaining):
                        self.pending.events.add(request_id=rid).chunk.CopyFrom(chunk)
                        self.ready.set()
        except asyncio.CancelledError:
            pass  # cancelled by the caller or with the stream: decode() aborted the request
        except Exception as e:  # noqa: BLE001 - every failure becomes this request's status
            self._fail(rid, e)

    def _done(self, rid: str, task: asyncio.Task) -> None:
        if self.tasks.get(rid) is task:
            del self.tasks[rid]
            request = self.unstarted.pop(rid, None)
            if request is not None:
                # Cancelled before it ran: the router, which sent the start, left the lease to
                # this worker's word that it will not read it, or to the lease's expiry.
                self.servicer.release_unstarted(request)
        self.ready.set()

    def _fail(self, rid: str, exc: Exception) -> None:
        code, message = status_and_message(exc)
        ev = self.pending.events.add(request_id=rid)
        ev.error.code = code.value[0]
        ev.error.message = message
        marks = {key for key, _ in failure_marks(exc)}
        ev.error.refused = REFUSED_KEY in marks
        ev.error.kv_source_failed = KV_SOURCE_FAILED_KEY in marks
        if ev.ByteSize() + _EVENT_FRAMING_BYTES > _message_limit():
            # An id near the message limit (a raw caller's; the router's are short): echoed
            # with the message, the event no message could carry failed the whole stream,
            # every request on it. Shortened, else dropped: that id's caller gets nothing.
            ev.error.message = "refused"
            if ev.ByteSize() + _EVENT_FRAMING_BYTES > _message_limit():
                del self.pending.events[-1]
                logger.warning("DecodeMany: no room in a message to refuse a request whose "
                               "id is %d characters (%s); nothing sent for it", len(rid),
                               message[:200])
        self.ready.set()

    def drain(self) -> None:
        self.draining = True
        self.ready.set()

    def cancel_all(self) -> None:
        for task in self.tasks.values():
            task.cancel()

    # --- the stream back ------------------------------------------------------------------
    async def batches(self) -> AsyncIterator[worker_pb2.DecodeBatch]:
        while True:
            if len(self.pending.events) > MAX_EVENTS_PER_BATCH:
                # A caller that stopped reading for a while must not get one message the size
                # of everything since: gRPC refuses messages over its limit, and 1024 events
                # (first chunks with prompt logprobs) can pass it too.
                batch = worker_pb2.DecodeBatch()
                batch.events.extend(self.pending.events[:MAX_EVENTS_PER_BATCH])
                del self.pending.events[:MAX_EVENTS_PER_BATCH]
                for part in _within_message_limit(batch):
                    yield part
            elif self.pending.events:
                batch, self.pending = self.pending, worker_pb2.DecodeBatch()
                for part in _within_message_limit(batch):
                    yield part
            elif (not self.reading or self.draining) and not self.tasks:
                if self.reading:  # draining: starts still on the wire will not be read
                    yield worker_pb2.DecodeBatch(closing=True)
                return
            else:
                await self.ready.wait()
                self.ready.clear()


@functools.cache
def _message_limit() -> int:
    return max_message_bytes()  # read once: the environment is the process's


def _within_message_limit(batch: worker_pb2.DecodeBatch) -> list[worker_pb2.DecodeBatch]:
    """``batch``, split where it would be over gRPC's message limit: one step's events of
    several requests (a local prefill's prompt_logprobs each) could add up past it, and a
    message over the limit fails the stream of every request on it. Each event fits alone
    (decode_svc/service.py refuses a chunk over the limit)."""
    limit = _message_limit()
    if batch.ByteSize() <= limit:
        return [batch]
    parts, size = [worker_pb2.DecodeBatch()], 0
    for ev in batch.events:
        n = ev.ByteSize() + _EVENT_FRAMING_BYTES
        if size + n > limit and parts[-1].events:
            parts.append(worker_pb2.DecodeBatch())
            size = 0
        parts[-1].events.append(ev)
        size += n
    return parts
