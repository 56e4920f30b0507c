"""A TCP proxy on loopback whose link can go silent: what a peer sees when the other end's host
is gone (powered off, a cable pulled, a NAT entry dropped) with its connection still open.

Until ``freeze()`` it passes bytes both ways; after, it passes none and closes nothing, so
neither end hears a FIN or a reset, and only a timeout or an unanswered ping can tell it.
"""
from __future__ import annotations

import socket
import threading


class Blackhole:
    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._closed = False
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="blackhole-accept", daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._flowing.set()  # frees the pumps, which find the proxy closed
        for s in [self._listener, *sockets]:
            s.close()

    def __enter__(self) -> Blackhole:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _accept(self) -> None:
        while True:
            try:
                near, _ = self._listener.accept()
                far = socket.create_connection(self._upstream)
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    near.close()
                    far.close()
                    return
                self._sockets += [near, far]
            for src, dst in ((near, far), (far, near)):
                threading.Thread(target=self._pump, args=(src, dst), name="blackhole-pump",
                                 daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(1 << 16)
            except OSError:
                return
            # Frozen: the bytes read are held, and the rest stay in the kernel's buffers.
            self._flowing.wait()
            if not data or self._closed:
                try:
                    dst.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                return
            try:
                dst.sendall(data)
            except OSError:
                return
