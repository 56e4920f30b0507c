"""The router's end of ``DecodeMany`` (decode_svc/mux.py): one stream per decode worker, shared
by every request the router sends it.

A request starts with a message on the stream and reads its chunks from a queue the stream's
reader fills; leaving early (client cancel, deadline, failure) sends a cancel. To the code above
it, a request here behaves as a ``Decode`` call would: its chunks, then the end, or an
``AioRpcError`` with the status its ``Decode`` call would have ended with. When the stream
itself breaks (the worker crashed, or stopped with requests still on it) every request on it
fails with UNAVAILABLE, which migrates them (router/migration.py); the next request opens a new
stream. The router sends a heartbeat on every stream each health-check interval, by which the
worker tells a hung router from a quiet one (decode_svc/mux.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc

from protos import worker_pb2, worker_pb2_grpc
from client.liveness import WatchedCalls, rpc_error
from engine.call_abort import KV_SOURCE_FAILED, REFUSED, was_refused
from router.liveness import LivenessConfig

logger = logging.getLogger(__name__)

_STATUS_BY_VALUE = {c.value[0]: c for c in grpc.StatusCode}
_DEADLINE = object()


def _detached(ev: worker_pb2.DecodeEvent) -> worker_pb2.DecodeEvent:
    """``ev`` copied out of its batch. An event read from a batch shares the batch's memory
    (protobuf's upb arena) and keeps all of it alive: the events a request that is not read
    (its client stopped reading) queued would hold every batch they came in, the output of
    every request on the stream meanwhile, not only its own. Copied only when queued behind
    another: a request read as its events come frees each batch at once."""
    own = worker_pb2.DecodeEvent()
    own.CopyFrom(ev)
    return own


@dataclass
class _Stream:
    call: grpc.aio.StreamStreamCall
    # Controls to send; None ends the request side (close()).
    outbox: asyncio.Queue
    # request_id -> its events (DecodeEvent; the stream's failure as an AioRpcError; _DEADLINE).
    requests: dict[str, asyncio.Queue] = field(default_factory=dict)
    broken: bool = False
    reader: asyncio.Task | None = None
    # Set when the liveness checks cut the stream (router/liveness.py): the worker hung.
    cut_reason: str | None = None
    watch_key: int | None = None
    heartbeats: asyncio.Task | None = None


class DecodeMux:
    def __init__(self, stub: worker_pb2_grpc.DecodeWorkerStub, worker_id: str,
                 calls: WatchedCalls | None = None,
                 liveness: LivenessConfig | None = None) -> None:
        self.stub = stub
        self.worker_id = worker_id
        self.liveness = liveness
        # The worker's watched calls: a liveness cut breaks the stream, as a crash would.
        self.calls = calls if calls is not None else WatchedCalls()
        self._stream: _Stream | None = None

    def _open(self) -> _Stream:
        s = self._stream
        if s is not None and not s.broken:
            return s
        outbox: asyncio.Queue = asyncio.Queue()

        async def controls() -> AsyncIterator[worker_pb2.DecodeControl]:
            while (ctl := await outbox.get()) is not None:
                yield ctl

        s = _Stream(self.stub.DecodeMany(controls()), outbox)
        s.watch_key, _ = self.calls.add(lambda reason: self._cut(s, reason))
        loop = asyncio.get_running_loop()
        s.reader = loop.create_task(self._read(s))
        if self.liveness is not None and self.liveness.enabled:
            s.heartbeats = loop.create_task(self._beat(s, self.liveness))
        self._stream = s
        return s

    @staticmethod
    async def _beat(s: _Stream, liveness: LivenessConfig) -> None:
        hb = worker_pb2.DecodeControl(heartbeat=worker_pb2.DecodeHeartbeat(
            interval_s=liveness.interval_s, misses=liveness.misses))
        while not s.broken:
            s.outbox.put_nowait(hb)
            await asyncio.sleep(liveness.interval_s)

    async def _read(self, s: _Stream) -> None:
        why = "the stream ended"
        marks = ()
        try:
            async for batch in s.call:
                for ev in batch.events:
                    queue = s.requests.get(ev.request_id)
                    if queue is not None:
                        queue.put_nowait(_detached(ev) if queue.qsize() else ev)
                if batch.closing:
                    # The worker is draining, and read none of the requests still open here.
                    why = "it closed the stream (draining) before reading the request"
                    marks = REFUSED
                    break
        except grpc.aio.AioRpcError as e:
            why = f"{e.code().name}: {e.details()}"
            # A stream that never connected carried none of its requests to the worker.
            marks = REFUSED if was_refused(e) else ()
        except asyncio.CancelledError:
            why = "the router closed the stream"
            raise
        finally:
            s.broken = True
            if s.heartbeats is not None:
                s.heartbeats.cancel()
            self.calls.remove(s.watch_key)
            why = s.cut_reason or why
            s.outbox.put_nowait(None)  # ends the controls() generator with the call
            if s.requests:
                err = rpc_error(grpc.StatusCode.UNAVAILABLE,
                                f"decode worker {self.worker_id}: {why}", marks)
                for queue in s.requests.values():
                    queue.put_nowait(err)

    async def decode(self, dreq: worker_pb2.DecodeRequest,
                     timeout: float) -> AsyncIterator[worker_pb2.DecodeChunk]:
        """``dreq``'s chunks, as a ``Decode(dreq, timeout=timeout)`` call would stream them."""
        s = self._open()
        rid = dreq.request_id
        if rid in s.requests:
            raise ValueError(f"request {rid} is already decoding on worker {self.worker_id}")
        events: asyncio.Queue = asyncio.Queue()
        s.requests[rid] = events
        s.outbox.put_nowait(worker_pb2.DecodeControl(
            start=worker_pb2.DecodeStart(request=dreq, timeout_s=timeout)))
        # The deadline arrives as an event: no timer task per chunk, and nothing fires while
        # the caller is away with a chunk (as a timeout scope across a yield would).
        expiry = asyncio.get_running_loop().call_later(timeout, events.put_nowait, _DEADLINE)
        ended = False
        try:
            while True:
                ev = await events.get()
                if ev is _DEADLINE:
                    raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
                if isinstance(ev, BaseException):  # the stream broke
                    raise ev
                if ev.HasField("error"):
                    ended = True
                    marks = ((REFUSED if ev.error.refused else ())
                             + (KV_SOURCE_FAILED if ev.error.kv_source_failed else ()))
                    raise rpc_error(_STATUS_BY_VALUE.get(ev.error.code, grpc.StatusCode.UNKNOWN),
                                    ev.error.message, marks)
                ended = bool(ev.chunk.finish_reason)
                yield ev.chunk
                if ended:
                    return
        finally:
            expiry.cancel()
            s.requests.pop(rid, None)
            if not ended and not s.broken:
                s.outbox.put_nowait(worker_pb2.DecodeControl(cancel=rid))

    @staticmethod
    def _cut(s: _Stream, reason: str) -> None:
        s.cut_reason = reason
        s.call.cancel()  # the reader then fails every request on the stream

    @property
    def num_requests(self) -> int:
        s = self._stream
        return 0 if s is None or s.broken else len(s.requests)

    async def close(self) -> None:
        s, self._stream = self._stream, None
        if s is None:
            return
        s.broken = True
        if s.heartbeats is not None:
            s.heartbeats.cancel()
        s.outbox.put_nowait(None)
        s.call.cancel()
        if s.reader is not None:
            s.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await s.reader
