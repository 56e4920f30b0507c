"""KV pulls on TP worker ranks: a second pipe between rank 0 and each worker, beside the step pipe.

A decode engine with TP>1 pulls a request's blocks on every rank at once, each rank into its
own cache. The pulls must not wait for a step, nor a step for a pull, so they never share the
step pipe: rank 0 sends pull requests on this channel, the worker runs each in its own thread
(concurrent requests overlap) and answers with the request's id. Messages are one op byte plus
JSON (handles travel as their own JSON bytes): never pickle.
"""
from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict
from multiprocessing.connection import Connection

from engine import tp_comm
from engine.openmp_threads import use_one_openmp_thread
from engine.thread_names import named_thread
from kvtransfer import (KVAgentHandle, LayoutMismatchError, PeerGoneError, TransferError,
                        TransferStats, TransferTimeout)

logger = logging.getLogger(__name__)

OP_KV_PULL = b"P"  # rank 0 -> worker: {"id", "remotes": [handle json], "remote_block_ids",
#                    "local_block_ids", "deadline"}: time.monotonic(), this host's clock
OP_KV_DONE = b"D"  # worker -> rank 0: {"id", "ok", "stats"} or {"id", "ok": false, "kind", "error"}
OP_KV_FORGET = b"F"  # rank 0 -> worker: {"agent_names"}; no answer (one busy is kept)

_KINDS = {"timeout": TransferTimeout, "peer_gone": PeerGoneError,
          "layout": LayoutMismatchError, "value": ValueError, "transfer": TransferError}


def _kind(e: BaseException) -> str:
    for name, cls in _KINDS.items():
        if isinstance(e, cls):
            return name
    return "transfer"


class WorkerKVServer:
    """In a worker process: serves rank 0's pull requests with this rank's agent."""

    def __init__(self, conn: Connection, agent) -> None:
        self.conn = conn
        self.agent = agent
        self._send_lock = threading.Lock()
        self._thread = named_thread(self._loop, "pdserve-tp-kv")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            try:
                op, payload = tp_comm.recv(self.conn)
            except (EOFError, OSError):
                return  # rank 0 closed the channel
            if op == OP_KV_FORGET:
                self._forget(payload)
            elif op == OP_KV_PULL:
                named_thread(self._pull, "pdserve-tp-kv-pull", (payload,)).start()
            else:
                logger.error("unknown KV channel op %r", op)
                return

    def _forget(self, payload: bytes) -> None:
        try:
            names = tp_comm.parse_json(payload)["agent_names"]
            for name in names:
                self.agent.forget_peer(str(name))
        except Exception:  # noqa: BLE001 - a peer kept is a leak, not a failure
            logger.exception("forgetting KV peers failed")

    def _pull(self, payload: bytes) -> None:
        use_one_openmp_thread()  # its copies must not start a team beside the rank's own
        req: dict = {}
        try:
            req = tp_comm.parse_json(payload)
            remotes = [KVAgentHandle.from_bytes(h.encode()) for h in req["remotes"]]
            # The deadline is rank 0's, not restarted here: a pull that waited to start (for
            # this thread, for the pipe) must not outlive the owner's lease.
            deadline = float(req["deadline"])
            stats = self.agent.pull(remotes, req["remote_block_ids"], req["local_block_ids"],
                                    max(deadline - time.monotonic(), 1e-3), deadline=deadline)
            reply = {"id": req["id"], "ok": True, "stats": asdict(stats)}
        except Exception as e:  # noqa: BLE001 - every failure goes back to rank 0
            reply = {"id": req.get("id"), "ok": False, "kind": _kind(e),
                     "error": f"tensor-parallel rank {self.agent.layout.tp_rank}: {e}",
                     "writes_may_land": bool(getattr(e, "writes_may_land", False))}
        try:
            with self._send_lock:
                tp_comm.send_json(self.conn, OP_KV_DONE, reply)
        except OSError:
            pass  # rank 0 is gone

    def close(self) -> None:
        self.conn.close()


class KVChannelClient:
    """Rank 0's end of every worker's KV channel: pull requests out, futures back."""

    def __init__(self, conns: list[Connection]) -> None:
        self.conns = conns
        self._ids = itertools.count()
        self._pending: dict[int, tuple[Future, int]] = {}  # id -> (future, rank)
        self._lock = threading.Lock()
        self._send_locks = [threading.Lock() for _ in conns]
        self._closed = False
        for i, c in enumerate(conns):
            named_thread(self._read, "pdserve-tp-kv-replies", (i + 1, c)).start()

    def submit(self, rank: int, remotes: list[KVAgentHandle], remote_block_ids: list[int],
               local_block_ids: list[int], deadline: float) -> Future:
        """Starts a pull on worker ``rank`` (1..); the future holds its TransferStats."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise TransferError("the TP workers' KV channels are closed")
            rid = next(self._ids)
            self._pending[rid] = (fut, rank)
        msg = json.dumps({"id": rid, "remotes": [h.to_bytes().decode() for h in remotes],
                          "remote_block_ids": [int(i) for i in remote_block_ids],
                          "local_block_ids": [int(i) for i in local_block_ids],
                          "deadline": deadline}).encode()
        try:
            with self._send_locks[rank - 1]:
                tp_comm.send(self.conns[rank - 1], OP_KV_PULL, msg)
        except OSError as e:
            with self._lock:
                self._pending.pop(rid, None)
            raise PeerGoneError(f"tensor-parallel rank {rank} is gone: {e}") from None
        return fut

    def forget(self, agent_names: list[str]) -> None:
        """Asks every worker to drop its connections to these remote agents."""
        msg = json.dumps({"agent_names": list(agent_names)}).encode()
        for lock, conn in zip(self._send_locks, self.conns):
            try:
                with lock:
                    tp_comm.send(conn, OP_KV_FORGET, msg)
            except OSError:
                pass  # a rank that is gone holds nothing

    def _read(self, rank: int, conn: Connection) -> None:
        try:
            while True:
                op, payload = tp_comm.recv(conn)
                reply = tp_comm.parse_json(payload)
                with self._lock:
                    fut, _ = self._pending.pop(reply.get("id"), (None, None))
                if fut is None:
                    continue
                if reply.get("ok"):
                    fut.set_result(TransferStats(**reply["stats"]))
                else:
                    cls = _KINDS.get(reply.get("kind"), TransferError)
                    exc = cls(reply.get("error", "unknown error"))
                    if isinstance(exc, TransferError):
                        exc.writes_may_land = bool(reply.get("writes_may_land"))
                    fut.set_exception(exc)
        except (EOFError, OSError, ValueError):
            pass
        self._fail_rank(rank, PeerGoneError(f"tensor-parallel rank {rank} stopped answering"))

    def _fail_rank(self, rank: int, exc: Exception) -> None:
        with self._lock:
            dead = [rid for rid, (_, r) in self._pending.items() if r == rank]
            futs = [self._pending.pop(rid)[0] for rid in dead]
        for f in futs:
            f.set_exception(exc)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        for c in self.conns:
            c.close()
