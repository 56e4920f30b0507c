"""Messages between a worker and its engine process: pickled, each behind its 4-byte length.

Two socket pairs, one per direction, so that each socket has one writer side and one reader
side: the reader is an event loop's (its socket non-blocking, so reads take whatever is there
and keep the rest of a message for later), the writer blocks until its message is out (a lock
keeps the writer threads' messages whole). An event loop never writes itself: it pickles a
message (so an error raises where it was sent) and a ``QueuedSender`` thread writes it, since a
peer that stopped reading (a wedged process) would block the loop in ``sendall`` for good.
"""
from __future__ import annotations

import logging
import pickle
import queue
import socket
import struct
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core_share import CoreShareConfig
from engine.outputs import EngineStats, RequestOutput
from engine.thread_names import named_thread

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
_READ_BYTES = 1 << 20
# In an output's wire tuple, in place of the prompt logprobs an earlier output of the request
# carried: they are complete once scored and go along with every later output in process, and
# sent each time they made every step message of a long prompt's request ~1 MB.
SENT_BEFORE = "sent-before"
# How often the engine process says ("tick",) from a thread of its own, whatever else it
# sends: a worker that hears nothing for long knows the process is wedged (stopped, or a C
# call holding its GIL, where its own step watchdog cannot run either).
TICK_S = 1.0


@dataclass
class EngineProcSpec:
    """What the worker sends first: how to build and run the engine."""

    engine: EngineConfig
    # Its base_threads is at most the engine's: the engine process lowers it to its torch
    # thread count (the worker never imports torch to ask).
    core_share: CoreShareConfig | None = None
    step_timeout_s: float | None = None


@dataclass
class EngineProcInfo:
    """What the worker learns once the engine is built (static for the engine's life)."""

    pid: int
    max_model_len: int
    kv_cache_layouts: list
    kv_transfer_handles: list
    stats: EngineStats


class PipeClosed(Exception):
    """The other side closed its end (its process ended)."""


class BadFrame(PipeClosed):
    """A message that cannot be unpickled: what else comes cannot be trusted either."""


def frame(msg: object) -> bytes:
    """``msg`` as it crosses: pickled, behind its length. Raises what pickling raises."""
    payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameWriter:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, msg: object) -> None:
        """Raises OSError once the other side is gone."""
        self.send_frame(frame(msg))

    def send_frame(self, data: bytes) -> None:
        """``frame``'s bytes; blocks until the other side has taken them."""
        with self._lock:
            self.sock.sendall(data)

    def close(self) -> None:
        self.sock.close()


class QueuedSender:
    """Sends for callers that must never wait for the other side (an event loop): ``send``
    pickles in the caller and queues; a thread of its own writes, in the order sent. Once the
    other side is gone, what is queued is dropped (its reader reports the end)."""

    def __init__(self, writer: FrameWriter, name: str) -> None:
        self.writer = writer
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = named_thread(self._run, name)
        self._thread.start()

    def send(self, msg: object) -> None:
        """Raises here what pickling ``msg`` raises; never waits for the other side."""
        self._queue.put(frame(msg))

    def close(self, timeout_s: float | None = None) -> None:
        """Stops the thread once what is queued is sent (or the other side is gone); waits for
        that up to ``timeout_s``. A thread blocked on a peer that stopped reading stays so until
        the peer ends (its send then fails): end the peer first."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        gone = False
        while (data := self._queue.get()) is not None:
            if gone:
                continue
            try:
                self.writer.send_frame(data)
            except OSError:
                gone = True
            except Exception:  # noqa: BLE001 - the thread must outlive any one message
                logger.exception("sending a message failed")


class FrameReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()
        # time.monotonic() when bytes last arrived: a peer that sends nothing for long is
        # wedged (it also sends ticks when it has nothing else to say).
        self.received_at = time.monotonic()

    def read_ready(self) -> list:
        """The messages complete after reading what the socket has now (none, if a message is
        still arriving); the socket must be non-blocking. Raises PipeClosed at the end of the
        stream once the messages before it are returned (read_blocking may have left some
        buffered: a peer's last words, sent just before it ended), BadFrame (once) for a
        message that cannot be unpickled."""
        end = None
        try:
            data = self.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            data = None
        except OSError as e:
            end = PipeClosed(str(e))
            data = None
        if data is not None:
            if data:
                self._received(data)
            else:
                end = PipeClosed("end of stream")
        msgs = self._take()
        if end is not None and not msgs:  # else the next read finds the end again
            raise end
        return msgs

    def read_blocking(self, timeout_s: float | None) -> object | None:
        """One message, waiting for it up to ``timeout_s`` (None: forever); None on timeout.
        Only before the socket is handed to an event loop."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            msgs = self._take(limit=1)
            if msgs:
                return msgs[0]
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(_READ_BYTES)
            except TimeoutError:
                return None
            finally:
                self.sock.settimeout(None)
            if not data:
                raise PipeClosed("end of stream")
            self._received(data)

    def _received(self, data: bytes) -> None:
        self._buf += data
        self.received_at = time.monotonic()

    def _take(self, limit: int | None = None) -> list:
        """The complete messages buffered, up to one that cannot be unpickled: that one is
        dropped and raises BadFrame when it comes first (the messages before it are returned
        first), so it raises once and never hides what follows."""
        msgs, pos, buf = [], 0, self._buf
        try:
            while len(buf) - pos >= _HEADER.size and (limit is None or len(msgs) < limit):
                (size,) = _HEADER.unpack_from(buf, pos)
                end = pos + _HEADER.size + size
                if len(buf) < end:
                    break
                try:
                    msgs.append(pickle.loads(buf[pos + _HEADER.size:end]))
                except Exception as e:  # noqa: BLE001 - whatever unpickling raises
                    if msgs:  # those first; this one raises on the next read
                        break
                    pos = end
                    raise BadFrame(f"a message could not be read: {type(e).__name__}: {e}") \
                        from e
                pos = end
        finally:
            if pos:
                del buf[:pos]
        return msgs

    def close(self) -> None:
        self.sock.close()


_AS_IS = object()


def encode_output(out: RequestOutput, prompt_logprobs=_AS_IS) -> tuple:
    """A step's output as it crosses: only what is new (the prompt and the tokens so far grow
    with the request, and the worker streams the new ones), as a tuple in field order (a
    dataclass pickles with its field names, and unpickles ~3x slower: at a batch of 256 that
    was 1.7 ms a step on the worker's loop). ``prompt_logprobs``: sent instead of the output's
    (``OutputEncoder``)."""
    lp = out.logprobs
    if lp:
        lp = lp[len(lp) - len(out.new_token_ids):]
    plp = out.prompt_logprobs if prompt_logprobs is _AS_IS else prompt_logprobs
    return (out.request_id, out.new_token_ids, out.text, out.text_delta, out.finished,
            out.finish_reason, out.stop_reason, lp, plp, out.num_cached_tokens,
            out.kv_lease, out.arrival_time, out.first_scheduled_time)


def decode_output(t: tuple) -> RequestOutput:
    """``encode_output``'s tuple as a RequestOutput (no prompt, no tokens before these)."""
    return RequestOutput(t[0], [], [], *t[1:])


def _last(out: RequestOutput) -> bool:
    """The request's last output: nothing more crosses for it."""
    return out.finished or out.kv_lease is not None


class OutputEncoder:
    """The engine process's side of ``encode_output``: a request's prompt logprobs cross with
    the first output that has them, later ones carry ``SENT_BEFORE`` for the same list. Used
    from one thread (the engine thread)."""

    def __init__(self) -> None:
        self._sent: dict[str, list] = {}  # request id -> its prompt logprobs, sent

    def encode(self, out: RequestOutput) -> tuple:
        rid, plp = out.request_id, out.prompt_logprobs
        if plp is not None:
            if self._sent.get(rid) is plp:
                plp = SENT_BEFORE
            else:
                self._sent[rid] = plp
        if _last(out):
            self._sent.pop(rid, None)
        return encode_output(out, plp)


class OutputDecoder:
    """The worker's side: puts the prompt logprobs sent once back on each output that had
    them, so outputs equal the in-process engine's. Used on the event loop."""

    def __init__(self) -> None:
        self._got: dict[str, list] = {}  # request id -> its prompt logprobs, received

    def decode(self, t: tuple) -> RequestOutput:
        out = decode_output(t)
        rid, plp = out.request_id, out.prompt_logprobs
        if plp == SENT_BEFORE:  # a list never equals it
            out.prompt_logprobs = self._got.get(rid)
        elif plp is not None:
            self._got[rid] = plp
        if _last(out):
            self._got.pop(rid, None)
        return out

    def forget_all(self) -> None:
        """The engine is gone: no output comes any more."""
        self._got.clear()
