"""The torch backend's control channel: length-prefixed JSON frames over a TCP socket.

Requests and replies are tiny (block ids, head ranges, a notification); the block data itself
goes through the pair's process group. JSON, never pickle: a peer can only send data.
"""
from __future__ import annotations

import json
import socket
import struct
import time

_HEADER = struct.Struct("!I")
# Block-id lists of a long prompt are a few hundred KB at most; anything bigger is garbage.
MAX_FRAME = 64 << 20


def wake(sock: socket.socket) -> None:
    """Shuts ``sock`` down both ways, waking a thread blocked in recv() or epoll on it (close()
    alone does neither on Linux). A socket never connected, or one the peer already reset,
    has nothing to wake."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def send_frame(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(_HEADER.pack(len(data)) + data)


def recv_frame(sock: socket.socket, deadline: float | None = None) -> dict:
    """The next frame as a dict; EOFError when the peer closed, ValueError on garbage.
    ``deadline`` (time.monotonic()): TimeoutError once it passed, however the frame's bytes
    trickle in (a socket timeout alone bounds each recv, not the frame)."""
    (size,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, deadline))
    if size > MAX_FRAME:
        raise ValueError(f"control frame of {size} bytes is over the {MAX_FRAME} limit")
    try:
        obj = json.loads(_recv_exact(sock, size, deadline))
    except (ValueError, RecursionError) as e:  # RecursionError: "[[[[..." nested too deep
        raise ValueError(f"bad control frame: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("bad control frame: not a JSON object")
    return obj


def _recv_exact(sock: socket.socket, n: int, deadline: float | None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no complete control frame before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("the peer closed the control connection")
        buf += chunk
    return bytes(buf)
