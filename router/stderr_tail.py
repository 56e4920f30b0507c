"""A launched service's stderr, passed on to the launcher's own and its last lines kept.

``pdserve up`` printed "decode could not be started again (the decode worker (pid N) exited
with 2 while starting)": why it exited was somewhere above, among every service's lines on the
one terminal. The launcher now reads each service's stderr through a pipe, writes it on to its
own fd 2 as it comes (bytes as they are, no decoding: what the terminal showed before), and
keeps the last few KiB, so a message about a service's exit can quote its last lines (its
``pdserve: error: ...``, a traceback's last line).
"""
from __future__ import annotations

import fcntl
import os
import threading

KEEP_BYTES = 8192
# A pipe holds 64 KiB by default: what a service writes while the launcher does not read (a
# `pdserve up` stopped by Ctrl-Z, until `bg`) past that blocks the service in its next log
# line, on its event loop: it stops serving (measured: the router hung after ~300 requests'
# access lines). 1 MiB holds some thousands of requests' lines; its memory is taken only as it
# fills, but each such pipe counts 256 pages against the user's fs.pipe-user-pages-soft (16384
# by default; root is exempt), past which the user's new pipes get 8 KiB: no more than 1 MiB,
# even where fs.pipe-max-size (the most an unprivileged process may ask) allows more.
PIPE_SIZE = 1 << 20
PIPE_MAX_SIZE_FILE = "/proc/sys/fs/pipe-max-size"


def widen(fd: int) -> int:
    """Makes the pipe of ``fd`` hold PIPE_SIZE, or as much as this process may; its size
    (0 where pipes cannot be resized: not Linux)."""
    if not hasattr(fcntl, "F_SETPIPE_SZ"):
        return 0
    try:
        with open(PIPE_MAX_SIZE_FILE) as f:
            size = min(int(f.read()), PIPE_SIZE)
        return fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except (OSError, ValueError):  # no /proc, or the user's pipe pages are spent: as it was
        return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


class StderrTail:
    def __init__(self, read_fd: int, out_fd: int = 2) -> None:
        self._fd = read_fd
        self._out = out_fd
        widen(read_fd)
        self._kept = b""
        self._lock = threading.Lock()
        self.closed = threading.Event()  # end of file: every writer of the pipe is gone
        threading.Thread(target=self._pump, name=f"stderr-tail-{read_fd}", daemon=True).start()

    def _pump(self) -> None:
        try:
            while chunk := os.read(self._fd, 65536):
                with self._lock:
                    self._kept = (self._kept + chunk)[-KEEP_BYTES:]
                self._write_on(chunk)
        except OSError:  # the read end closed under it: nothing more to pass on
            pass
        finally:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self.closed.set()

    def _write_on(self, chunk: bytes) -> None:
        # The launcher's stderr gone (a closed pipe) must not stop the reading: the service
        # would block on a full pipe.
        try:
            while chunk:
                chunk = chunk[os.write(self._out, chunk):]
        except OSError:
            pass

    def last_lines(self, n: int = 3, wait_s: float = 0.0) -> list[str]:
        """The last ``n`` non-blank lines written so far, each cut to 300 characters; with
        ``wait_s``, first until the pipe's end of file, at most that long (once the service
        exited, what it wrote last may still be in the pipe)."""
        if wait_s > 0:
            self.closed.wait(wait_s)
        with self._lock:
            text = self._kept.decode(errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return [ln if len(ln) <= 300 else ln[:297] + "..." for ln in lines[-n:]]
