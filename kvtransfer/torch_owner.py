"""The torch backend's owner side: serves pulls of this rank's blocks from background threads.

A reader connects to the control server once per (reader agent, owner agent) pair and says
hello; both sides then build the pair's process group over this owner's TCPStore. Each pull
request names blocks and a head range; the owner gathers them into one contiguous tensor and
sends it through the group. Release notifications arrive on the same connection, after the
hello. One thread per connected reader, so a slow reader never holds up another, and at most
MAX_CONNECTIONS of them.
"""
from __future__ import annotations

import base64
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
from kvtransfer.torch_pair import (OWNER_RANK, READER_RANK, client_store, make_pair_group,
                                   wait_work)

logger = logging.getLogger(__name__)
_ACCEPT_TICK_S = 0.5
# The longest this owner waits on a reader's word (its hello's join, a pull's send), whatever
# timeout the reader names: a hello naming 1e6 s pinned a thread here for that long.
MAX_READER_WAIT_S = 120.0
_MAX_TAG = 2**31 - 1
_IDLE_CLIENTS = 4
# How long close() waits for store clients being built (milliseconds each on a live server).
_CONNECT_WAIT_S = 10.0
# Connections served at once, each on its own thread. A reader agent holds one per owner
# agent, so this is far beyond a cluster's decode ranks; 500 idle connections were 500
# threads here before.
MAX_CONNECTIONS = 256
# A reader says hello as soon as it connects; a connection that says nothing (or trickles)
# within this held a thread and a connection for good.
HELLO_TIMEOUT_S = 10.0
# After its hello a connection waits for the reader's next pull with no time limit, for as
# long as the reader keeps its pair. A reader whose host vanished (crashed, cut off: no FIN or
# RST ever comes) held its thread, its pair group and one of MAX_CONNECTIONS for good. TCP
# keepalive probes, answered by the reader's kernel even while its process is stopped, end
# such a connection after KEEPALIVE_IDLE_S of silence and KEEPALIVE_PROBES unanswered probes.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 10
KEEPALIVE_PROBES = 3
# Notifications waiting for the engine's poll (every 20 ms; a release is a few dozen bytes):
# beyond these they are refused (see _queue_notification). 200 of 1 MiB queued 200 MiB.
MAX_QUEUED_NOTIFICATIONS = 100_000
MAX_QUEUED_NOTIFICATION_BYTES = 64 << 20


class TorchOwnerServer:
    def __init__(self, cache: torch.Tensor, layout: KVCacheLayout, host: str,
                 name: str) -> None:
        self.cache = cache
        self.layout = layout
        self.host = host
        self.name = name
        self.device_type = cache.device.type
        # Only this reference holds the store's server: close() drops it, which closes the
        # port. Pair groups join through clients of it (not the server object itself, which a
        # join still waiting would keep alive), so dropping it also ends their waits.
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, 0, None, True, wait_for_workers=False, timeout=datetime.timedelta(seconds=60))
        self.store_port = self._store.port
        self._idle_clients: list[dist.TCPStore] = []
        # The client that deletes ended pairs' keys (_forget_pair_keys), made on first use.
        self._janitor: dist.TCPStore | None = None
        self._janitor_lock = threading.Lock()
        self._listener = socket.create_server((host, 0))
        self._listener.settimeout(_ACCEPT_TICK_S)
        self.port = self._listener.getsockname()[1]
        self._notifs: list[bytes] = []
        self._notif_bytes = 0
        self._refusing_notifs = False
        self._conns: set[socket.socket] = set()
        self._refusing_conns = False  # only the accept thread reads or sets it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        # Store clients being built now, and close()'s wait for them: see _take_client.
        self._connecting = 0
        self._connected = threading.Condition(self._lock)
        self._acceptor = named_thread(self._accept_loop, "pdserve-kv-owner")
        self._acceptor.start()

    @property
    def num_readers(self) -> int:
        """Reader agents connected now."""
        with self._lock:
            return len(self._conns)

    def take_notifications(self) -> list[bytes]:
        with self._lock:
            out, self._notifs, self._notif_bytes = self._notifs, [], 0
        return out

    def _queue_notification(self, msg: bytes) -> None:
        """Queues ``msg`` for take_notifications(), or refuses it (logged) when the queue is
        full. The newest is refused rather than the oldest dropped: a release lost either way
        only leaves its lease to expire (its blocks stay out of use until then, never handed
        out early), and a reader flooding this owner then loses its own notifications instead
        of evicting the releases others sent before it."""
        with self._lock:
            full = (len(self._notifs) >= MAX_QUEUED_NOTIFICATIONS
                    or self._notif_bytes + len(msg) > MAX_QUEUED_NOTIFICATION_BYTES)
            if not full:
                self._notifs.append(msg)
                self._notif_bytes += len(msg)
            warn = full and not self._refusing_notifs
            self._refusing_notifs = full
            queued = (len(self._notifs), self._notif_bytes)
        if warn:  # once per run of refusals, not once per notification of a flood
            logger.warning("KV owner %r refuses notifications: %d (%d bytes) wait for the "
                           "engine's poll already", self.name, *queued)

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keep_alive(conn)
            with self._lock:
                if self._closed.is_set():
                    conn.close()
                    return
                full = len(self._conns) >= MAX_CONNECTIONS
                if not full:
                    self._conns.add(conn)
            if full:
                self._refuse(conn)
                continue
            self._refusing_conns = False
            named_thread(self._serve, "pdserve-kv-serve", (conn,)).start()

    def _refuse(self, conn: socket.socket) -> None:
        """Closes a connection over MAX_CONNECTIONS, telling its reader why if its socket
        takes the reply at once (the accept loop never waits on a peer)."""
        if not self._refusing_conns:  # once per run of refusals: a flood would flood the log
            logger.warning("KV owner %r serves %d connections already; refusing more",
                           self.name, MAX_CONNECTIONS)
            self._refusing_conns = True
        try:
            conn.setblocking(False)
            wire.send_frame(conn, {"ok": False, "error": f"KV owner {self.name!r} serves "
                                                        f"{MAX_CONNECTIONS} connections"})
        except OSError:
            pass
        conn.close()

    def _serve(self, conn: socket.socket) -> None:
        use_one_openmp_thread()  # its gathers must not start a team beside the engine's
        prefix = None
        try:
            # Only a reader's hello opens the connection to pulls and notifications: a
            # notification from anything that connected was queued for the engine.
            req = wire.recv_frame(conn, time.monotonic() + HELLO_TIMEOUT_S)
            if req.get("op") != "hello":
                raise ValueError(f"a connection starts with a hello, not {req.get('op')!r}")
            conn.settimeout(None)  # idle between pulls for as long as the reader keeps its pair
            prefix = req.get("prefix")  # _hello checks it before the join writes under it
            pg = self._hello(conn, req)
            while True:
                req = wire.recv_frame(conn)
                op = req.get("op")
                if op == "pull":
                    self._pull(conn, pg, req)
                elif op == "notify":
                    msg = base64.b64decode(str(req.get("msg", "")), validate=True)
                    self._queue_notification(msg)
                else:
                    raise ValueError(f"unknown control op {op!r} after the hello")
        except (EOFError, OSError):
            pass  # the reader left, said no hello in time, or we are closing
        except (ValueError, TransferError, RuntimeError) as e:
            if not self._closed.is_set():
                logger.warning("KV owner dropped a reader connection: %s", e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()
            if isinstance(prefix, str) and prefix:
                self._forget_pair_keys(prefix)

    def _forget_pair_keys(self, prefix: str) -> None:
        """Deletes what the pair's join left in the store, once its connection ended. Kept,
        every pair ever joined here stayed in the store's memory (about 500 bytes each): a
        reader makes a new pair after each failed pull, and each time it starts. The keys are
        gloo's own (ProcessGroupGloo's device 0, then each rank's address), read by the join
        only; NCCL's are left, as its first send reads them. One client does it for every
        connection, one at a time: readers dropping many connections at once would otherwise
        make a burst of store connections, which stalls the store's server for seconds."""
        if self.device_type == "cuda":
            return
        with self._janitor_lock:
            try:
                if self._janitor is None:
                    self._janitor = self._new_client()
                pair_store = dist.PrefixStore(prefix, self._janitor)
                for rank in (OWNER_RANK, READER_RANK):
                    pair_store.delete_key(f"0/{rank}")
            except (TransferError, RuntimeError):
                self._janitor = None  # closing, or the store failed: the next one makes another

    def _hello(self, conn: socket.socket, req: dict):
        prefix = req.get("prefix")
        if not isinstance(prefix, str) or not prefix:
            raise ValueError(f"a hello names a store prefix, got {prefix!r}")
        timeout_s = reader_timeout(req)
        store = self._take_client()
        # The reader builds its side at the same time; the constructor returns once both did.
        # A failed join's client is dropped: its timed-out wait may still be queued at the
        # server, whose answer would pass for the next join's.
        pg = make_pair_group(store, prefix, OWNER_RANK, self.device_type, self.host, timeout_s)
        self._give_back_client(store)
        try:
            self._check_hello_names_this_cache(req)
        except ValueError as e:
            # Refused only after the join: the reader's side would otherwise wait for it until
            # its timeout (on a thread it cannot stop), though it has its answer.
            wire.send_frame(conn, {"ok": False, "kind": "layout", "error": str(e)})
            raise
        wire.send_frame(conn, {"ok": True})
        return pg

    def _take_client(self) -> dist.TCPStore:
        """A store client for one join. One per join under way, not one shared: a client
        serializes its calls, so a reader that never joined held up every other join for its
        timeout. Kept for the next join once done: the store's server stalls for seconds
        after every few dozen connections made in a burst."""
        with self._lock:
            if self._idle_clients and not self._closed.is_set():
                return self._idle_clients.pop()
        return self._new_client()

    def _new_client(self) -> dist.TCPStore:
        """A new store client; TransferError once the owner is closing."""
        with self._lock:
            if self._closed.is_set():
                raise TransferError("the KV owner is closing")
            self._connecting += 1
        try:
            # Its constructor pings the server with no time limit: a server dropped while a
            # client connects can leave it waiting for good (a thread per hello, seen on a
            # loaded host). close() waits for these before it drops the server.
            return client_store(self.host, self.store_port, MAX_READER_WAIT_S)
        finally:
            with self._lock:
                self._connecting -= 1
                self._connected.notify_all()

    def _give_back_client(self, store: dist.TCPStore) -> None:
        # NCCL reads the store again at its first send (its unique id); gloo only joining.
        if self.device_type == "cuda":
            return
        with self._lock:
            if not self._closed.is_set() and len(self._idle_clients) < _IDLE_CLIENTS:
                self._idle_clients.append(store)

    def _check_hello_names_this_cache(self, req: dict) -> None:
        """ValueError when the reader's handle names another agent or layout than this one (a
        stale handle, or another owner's that now listens on this port): its pulls would read
        the wrong blocks, or sizes the reader does not expect. A reader from before these
        fields sends neither, and is let through."""
        agent = req.get("agent")
        if agent is not None and agent != self.name:
            raise ValueError(f"this is KV agent {self.name!r}, not {agent!r}")
        if req.get("layout") is not None:
            theirs = KVCacheLayout.from_dict(req["layout"])
            if theirs != self.layout:
                raise ValueError(f"KV agent {self.name!r} has layout {self.layout}; the "
                                 f"reader's handle says {theirs}")

    def _pull(self, conn: socket.socket, pg, req: dict) -> None:
        try:
            tag = req.get("tag")
            if isinstance(tag, bool) or not isinstance(tag, int) or not 0 <= tag <= _MAX_TAG:
                raise ValueError(f"a pull's tag is an integer in [0, {_MAX_TAG}], got {tag!r}")
            deadline = time.monotonic() + reader_timeout(req)
            data = self._gather(req)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            wire.send_frame(conn, {"ok": False, "error": str(e)})
            return
        wire.send_frame(conn, {"ok": True, "nbytes": data.numel() * data.element_size()})
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
            wire.wake(self._listener)  # close() alone leaves accept() asleep to its tick
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            wire.wake(c)
        with self._lock:  # no client is being built against the server dropped next
            self._connected.wait_for(lambda: self._connecting == 0, timeout=_CONNECT_WAIT_S)
        # Stops the store's server (the last reference): its port closes, and a serve thread
        # waiting in a join for a reader that never joins fails now. One sending to a stalled
        # reader is left to end by itself, within MAX_READER_WAIT_S.
        self._store = None
        with self._lock:
            self._idle_clients.clear()
        self._janitor = None
        self._acceptor.join(timeout=2 * _ACCEPT_TICK_S + 1)


def _keep_alive(conn: socket.socket) -> None:
    """Probes ``conn``'s peer once it idles (see KEEPALIVE_IDLE_S); the timings where the
    platform lets them be set (Linux; macOS names the idle time TCP_KEEPALIVE)."""
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle = getattr(socket, "TCP_KEEPIDLE", getattr(socket, "TCP_KEEPALIVE", None))
    for opt, value in ((idle, KEEPALIVE_IDLE_S),
                       (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
                       (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_PROBES)):
        if opt is not None:
            conn.setsockopt(socket.IPPROTO_TCP, opt, value)


def reader_timeout(req: dict) -> float:
    """A reader's ``timeout_s``, at most MAX_READER_WAIT_S; ValueError unless a number > 0."""
    t = req.get("timeout_s", 30.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0:
        raise ValueError(f"timeout_s must be a number > 0, got {t!r}")
    return float(min(t, MAX_READER_WAIT_S))
