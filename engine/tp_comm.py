"""How tensor-parallel ranks talk: a c10d process group for the tensors, a pipe for control.

The process group is built straight from a TCP store (no ``init_process_group``), so a process
can hold TP groups and KV-transfer groups side by side. Control messages between rank 0 and a
worker are one op byte plus raw bytes (JSON or the step codec's int64 buffer): never pickle.
"""
from __future__ import annotations

import datetime
import json
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from engine.parallel_state import TPGroup

# rank 0 -> worker
OP_STEP = b"S"  # payload: engine.step_codec buffer
OP_NUM_BLOCKS = b"B"  # payload: {"num_blocks": int}
OP_READ_BLOCKS = b"R"  # payload: {"block_ids": [int]}; reply OP_OK with the raw block bytes
OP_QUIT = b"Q"
# worker -> rank 0
OP_HELLO = b"H"  # payload: {"capacity_blocks": int}
OP_READY = b"L"  # payload: the worker's KVCacheLayout as JSON
OP_OK = b"K"
OP_ERROR = b"E"  # payload: utf-8 error text

# A collective that waits this long for a live peer gives up (a dead peer is seen at once).
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
