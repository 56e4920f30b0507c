"""How tensor-parallel ranks talk: a c10d process group for the tensors, a pipe for control.

The process group is built straight from a TCP store (no ``init_process_group``), so a process
can hold TP groups and KV-transfer groups side by side. Control messages between rank 0 and a
worker are one op byte plus raw bytes (JSON or the step codec's int64 buffer): never pickle.
"""
from __future__ import annotations

import datetime
import json
import os
import select
import struct
import time
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.parallel_state import TPGroup

# rank 0 -> worker
OP_STEP = b"S"  # payload: engine.step_codec buffer
OP_NUM_BLOCKS = b"B"  # payload: {"num_blocks": int}
OP_READ_BLOCKS = b"R"  # payload: {"block_ids": [int]}; reply OP_OK with the raw block bytes
OP_QUIT = b"Q"
OP_PING = b"P"  # idle liveness check (tp_executor); reply OP_OK, empty
# worker -> rank 0
OP_HELLO = b"H"  # payload: {"capacity_blocks": int}
OP_READY = b"L"  # payload: the worker's KVCacheLayout as JSON
OP_OK = b"K"
OP_ERROR = b"E"  # payload: utf-8 error text

# A collective that waits this long for a live peer gives up (a dead peer is seen at once);
# so does rank 0's send of a step to a worker that does not take it (tp_executor).
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def connect_tp_group(rank: int, size: int, store: dist.Store, device: torch.device) -> TPGroup:
    """This rank's member of the group; gloo on CPU, NCCL on CUDA.

    Connections are made lazily, on the first collective, so building the group never blocks
    on a peer that may already have died; start-up runs one collective once all ranks are up.
    """
    prefixed = dist.PrefixStore("pdserve-tp", store)
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        backend = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
    else:
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = COLLECTIVE_TIMEOUT
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1",
                                                             lazy_init=True)]
        backend = dist.ProcessGroupGloo(prefixed, rank, size, opts)
    return TPGroup(rank, size, backend)


def send(conn: Connection, op: bytes, payload: bytes = b"") -> None:
    conn.send_bytes(op + payload)


def send_by(conn: Connection, op: bytes, payload: bytes, deadline: float) -> None:
    """``send`` to a peer that may have stopped reading (SIGSTOPped, wedged): a message larger
    than the socket holds would block a plain send for good. Waits for the peer to take it
    until ``deadline`` (time.monotonic()), then raises TimeoutError, the message part-sent
    (the pipe is of no use after that); OSError once the peer is gone."""
    size = len(op) + len(payload)
    # multiprocessing.connection's framing, which the peer's recv_bytes reads.
    head = struct.pack("!i", size) if size <= 0x7fffffff else struct.pack("!iQ", -1, size)
    unsent = [head + op, memoryview(payload)]  # the payload (~1 MB a step) is not copied
    started = time.monotonic()
    # conn.fileno() each time: it raises once a shutdown on another thread closed the pipe
    # (its number may then name another file). Non-blocking only while sending: recv_bytes
    # expects a blocking socket.
    os.set_blocking(conn.fileno(), False)
    try:
        while True:
            try:
                unsent = _past(unsent, os.writev(conn.fileno(), unsent))
            except BlockingIOError:
                pass
            if not unsent:
                return
            left = deadline - time.monotonic()
            # A peer gone wakes the poll too (POLLHUP): the next write raises EPIPE.
            if left <= 0 or not _writable(conn.fileno(), left):
                raise TimeoutError(f"it has not taken a {size}-byte message in "
                                   f"{time.monotonic() - started:.0f} s")
    finally:
        if not conn.closed:
            os.set_blocking(conn.fileno(), True)


def _past(bufs: list, sent: int) -> list:
    """``bufs`` without their first ``sent`` bytes."""
    while bufs and len(bufs[0]) <= sent:
        sent -= len(bufs.pop(0))
    if sent:
        bufs[0] = memoryview(bufs[0])[sent:]
    return bufs


def _writable(fd: int, timeout_s: float) -> bool:
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    return bool(poller.poll(timeout_s * 1000))


def send_json(conn: Connection, op: bytes, obj: dict) -> None:
    send(conn, op, json.dumps(obj).encode())


def recv(conn: Connection) -> tuple[bytes, bytes]:
    """(op, payload) of the next message; EOFError when the other side is gone."""
    data = conn.recv_bytes()
    if not data:
        raise ValueError("empty control message")
    return data[:1], data[1:]


def parse_json(payload: bytes) -> dict:
    try:
        obj = json.loads(payload)
    except ValueError as e:
        raise ValueError(f"bad control message: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError("bad control message: not a JSON object")
    return obj
