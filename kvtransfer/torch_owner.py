"""The torch backend's owner side: serves pulls of this rank's blocks from background threads.

A reader connects to the control server once per (reader agent, owner agent) pair and says
hello; both sides then build the pair's process group over this owner's TCPStore. Each pull
request names blocks and a head range; the owner gathers them into one contiguous tensor and
sends it through the group. Release notifications arrive on the same connection. One thread
per connected reader, so a slow reader never holds up another.
"""
from __future__ import annotations

import base64
import collections
import datetime
import logging
import socket
import threading
import time

import torch
import torch.distributed as dist

from engine.kv_layout import KVCacheLayout
from engine.openmp_threads import use_one_openmp_thread
from engine.thread_names import named_thread
from kvtransfer import wire
from kvtransfer.errors import TransferError
from kvtransfer.plan import check_block_ids
from kvtransfer.torch_pair import OWNER_RANK, READER_RANK, make_pair_group, wait_work

logger = logging.getLogger(__name__)
_ACCEPT_TICK_S = 0.5


class TorchOwnerServer:
    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, host: str) -> None:
        self.cache = cache
        self.layout = layout
        self.host = host
        self.device_type = cache.device.type
        self.store = dist.TCPStore(host, 0, None, True, wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=60))
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_TICK_S)
        self.port = self._listener.getsockname()[1]
        self._notifs: collections.deque[bytes] = collections.deque()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._acceptor = named_thread(self._accept_loop, "pdserve-kv-owner")
        self._acceptor.start()

    @property
    def num_readers(self) -> int:
        """Reader agents connected now."""
        with self._lock:
            return len(self._conns)

    def take_notifications(self) -> list[bytes]:
        out = []
        while self._notifs:
            out.append(self._notifs.popleft())
        return out

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                self._conns.add(conn)
            named_thread(self._serve, "pdserve-kv-serve", (conn,)).start()

    def _serve(self, conn: socket.socket) -> None:
        use_one_openmp_thread()  # its gathers must not start a team beside the engine's
        pg = None
        try:
            while True:
                req = wire.recv_frame(conn)
                op = req.get("op")
                if op == "hello":
                    pg = self._hello(conn, req)
                elif op == "pull":
                    if pg is None:
                        raise ValueError("pull before hello")
                    self._pull(conn, pg, req)
                elif op == "notify":
                    self._notifs.append(base64.b64decode(str(req.get("msg", "")), validate=True))
                else:
                    raise ValueError(f"unknown control op {op!r}")
        except (EOFError, OSError):
            pass  # the reader left (or we are closing)
        except (ValueError, TransferError, RuntimeError) as e:
            if not self._closed.is_set():
                logger.warning("KV owner dropped a reader connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _hello(self, conn: socket.socket, req: dict):
        prefix = str(req["prefix"])
        timeout_s = float(req.get("timeout_s", 30.0))
        # The reader builds its side at the same time; the constructor returns once both did.
        pg = make_pair_group(self.store, prefix, OWNER_RANK, self.device_type, self.host,
                             timeout_s)
        wire.send_frame(conn, {"ok": True})
        return pg

    def _pull(self, conn: socket.socket, pg, req: dict) -> None:
        try:
            tag = int(req["tag"])
            data = self._gather(req)
        except (KeyError, TypeError, ValueError) as e:
            wire.send_frame(conn, {"ok": False, "error": str(e)})
            return
        wire.send_frame(conn, {"ok": True, "nbytes": data.numel() * data.element_size()})
        deadline = time.monotonic() + float(req.get("timeout_s", 30.0))
        wait_work(pg.send([data], READER_RANK, tag), deadline, self.device_type,
                  "sending KV blocks")

    def _gather(self, req: dict) -> torch.Tensor:
        """[n, num_layers, 2, block_size, num_heads, head_size] of the requested blocks."""
        lay = self.layout
        ids = check_block_ids(req["block_ids"], lay.num_blocks, "remote")
        start, num = int(req["head_start"]), int(req["num_heads"])
        lo = start - lay.kv_head_start
        if num < 1 or lo < 0 or lo + num > lay.num_kv_heads:
            raise ValueError(f"heads [{start}, {start + num}) are not on this rank "
                             f"([{lay.kv_head_start}, {lay.kv_head_start + lay.num_kv_heads}))")
        index = torch.from_numpy(ids).to(self.cache.device)
        blocks = self.cache.index_select(0, index)
        if num == lay.num_kv_heads:
            return blocks
        return blocks[..., lo:lo + num, :].contiguous()

    def close(self) -> None:
        self._closed.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._acceptor.join(timeout=2 * _ACCEPT_TICK_S + 1)
