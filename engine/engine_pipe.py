"""Messages between a worker and its engine process: pickled, each behind its 4-byte length.

Two socket pairs, one per direction, so that each socket has one writer side and one reader
side: the reader is an event loop's (uvloop makes a socket it watches non-blocking, so reads
take whatever is there and keep the rest of a message for later), the writer blocks until its
message is out (a lock keeps the writer threads' messages whole).
"""
from __future__ import annotations

import pickle
import socket
import struct
import threading
import time
from dataclasses import dataclass

from engine.config import EngineConfig
from engine.core_share import CoreShareConfig
from engine.outputs import EngineStats, RequestOutput

_HEADER = struct.Struct("!I")
_READ_BYTES = 1 << 20


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


class FrameWriter:
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        self.sock = sock
        self._lock = threading.Lock()

    def send(self, msg: object, timeout_s: float | None = None) -> None:
        """Raises OSError once the other side is gone; with ``timeout_s``, TimeoutError (an
        OSError) when the other side has not taken it by then (the stream is then cut short:
        for a last message only)."""
        payload = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        if not self._lock.acquire(timeout=-1 if timeout_s is None else timeout_s):
            raise TimeoutError("another send holds the pipe")
        try:
            if timeout_s is not None:
                self.sock.settimeout(timeout_s)
            try:
                self.sock.sendall(_HEADER.pack(len(payload)) + payload)
            finally:
                if timeout_s is not None:
                    self.sock.setblocking(True)
        finally:
            self._lock.release()

    def close(self) -> None:
        self.sock.close()


class FrameReader:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = bytearray()

    def read_ready(self) -> list:
        """The messages complete after reading what the socket has now (none, if a message is
        still arriving). Raises PipeClosed at the end of the stream."""
        try:
            data = self.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as e:
            raise PipeClosed(str(e)) from e
        if not data:
            raise PipeClosed("end of stream")
        self._buf += data
        return self._take()

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
            self._buf += data

    def _take(self, limit: int | None = None) -> list:
        msgs, pos, buf = [], 0, self._buf
        while len(buf) - pos >= _HEADER.size and (limit is None or len(msgs) < limit):
            (size,) = _HEADER.unpack_from(buf, pos)
            end = pos + _HEADER.size + size
            if len(buf) < end:
                break
            msgs.append(pickle.loads(buf[pos + _HEADER.size:end]))
            pos = end
        if pos:
            del buf[:pos]
        return msgs

    def close(self) -> None:
        self.sock.close()


def encode_output(out: RequestOutput) -> tuple:
    """A step's output as it crosses: only what is new (the prompt and the tokens so far grow
    with the request, and the worker streams the new ones), as a tuple in field order (a
    dataclass pickles with its field names, and unpickles ~3x slower: at a batch of 256 that
    was 1.7 ms a step on the worker's loop)."""
    lp = out.logprobs
    if lp:
        lp = lp[len(lp) - len(out.new_token_ids):]
    return (out.request_id, out.new_token_ids, out.text, out.text_delta, out.finished,
            out.finish_reason, out.stop_reason, lp, out.prompt_logprobs, out.num_cached_tokens,
            out.kv_lease, out.arrival_time, out.first_scheduled_time)


def decode_output(t: tuple) -> RequestOutput:
    """``encode_output``'s tuple as a RequestOutput (no prompt, no tokens before these)."""
    return RequestOutput(t[0], [], [], *t[1:])
