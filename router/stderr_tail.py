"""A launched service's stderr: a file it writes, passed on to the launcher's own and its last
lines kept.

``pdserve up`` printed "decode could not be started again (the decode worker (pid N) exited
with 2 while starting)": why it exited was somewhere above, among every service's lines on the
one terminal. The launcher passes each service's stderr on to its own fd 2 as it comes (bytes
as they are, no decoding: what the terminal showed before) and keeps the last few KiB, so a
message about a service's exit can quote its last lines (its ``pdserve: error: ...``, a
traceback's last line).

Not through a pipe: a launcher that did not read (stopped by SIGSTOP, or by Ctrl-Z with its
services in sessions of their own) left each service blocked in its next log line once the
pipe was full (64 KiB; 1 MiB widened), on its event loop: the router stopped answering. Each
service now writes its stderr (and its engine process and TP ranks, which inherit it) to a
file of its own, appending, and nothing it writes ever waits for the launcher. The launcher
reads the file from where it stopped, woken by inotify, and gives back to the file system what
it has passed on (a hole punched over it): the file's blocks stay those not yet read. A
stopped launcher leaves them to grow until it runs again: disk rather than a stalled service.
A launcher that is killed leaves the files where they are, with the services' last lines (the
ones they wrote as they stopped for its death) at their ends.

Every writer gone (the service and whatever it started: the pipe's end of file before) is
inotify's IN_CLOSE_WRITE, sent once the last process holding the file's shared open file
description closed it; where inotify cannot be had (not Linux, the user's inotify instances
spent), the service's own exit (``watch``) stands for it. A process that opens the file anew
(``open("/dev/stderr")``, a script's ``2>/dev/stderr``: through a pipe, the same pipe) sends
one too as it closes its own description: one seen while the service still holds the file as
its stderr is not the last (before, the launcher stopped passing the service's lines on, for
its life); one that opened it ``"w"`` also emptied the file, which is then read from its
start again.
"""
from __future__ import annotations

import ctypes
import errno
import os
import select
import struct
import subprocess
import threading

KEEP_BYTES = 8192
# What has been passed on is given back to the file system in steps this large.
RECLAIM_BYTES = 1 << 20
# How long the reader sleeps without an inotify event (a backstop where inotify works).
POLL_S = 0.5
_CHUNK = 65536
_IN_MODIFY, _IN_CLOSE_WRITE = 0x2, 0x8
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x1, 0x2
_EVENT = struct.Struct("iIII")  # struct inotify_event, without its name
# A multiple of any file system's block size (ext4's and XFS's: 4 KiB): punches start at one.
_BLOCK = 65536


def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):  # no such functions: not Linux
        return None


_LIBC = _libc()


class StderrTail:
    """Creates ``path`` for a service's stderr: pass ``write_fd`` as its stderr, then call
    ``started`` (with its Popen, or None if it could not be started)."""

    def __init__(self, path: str, out_fd: int = 2) -> None:
        self.path = path
        self._out = out_fd
        # O_APPEND: every writer (the service, its engine process, TP ranks) writes at the end,
        # wherever the others are.
        self.write_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND
                                | os.O_CLOEXEC, 0o600)
        # Our own open file description: its close is not the services' IN_CLOSE_WRITE.
        self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self._notify = self._watch(path)
        self._pos = 0  # what was read and passed on
        self._freed = 0  # what was given back to the file system
        self._punch = _LIBC is not None
        self._kept = b""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._process: subprocess.Popen | None = None
        self.closed = threading.Event()  # every writer gone, and all it wrote passed on
        self._thread = threading.Thread(target=self._pump, name=f"stderr-tail-{path}",
                                        daemon=True)

    def started(self, process: subprocess.Popen | None) -> None:
        """The service holds its stderr now (or never will: None): the launcher's copy is
        closed, so the file's last writer is the service's last process."""
        self._process = process
        os.close(self.write_fd)
        self.write_fd = -1
        self._thread.start()

    @staticmethod
    def _watch(path: str) -> int | None:
        if _LIBC is None:
            return None
        fd = _LIBC.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if fd < 0:
            return None
        if _LIBC.inotify_add_watch(fd, os.fsencode(path), _IN_MODIFY | _IN_CLOSE_WRITE) < 0:
            os.close(fd)
            return None
        return fd

    def _pump(self) -> None:
        writers_gone = False
        try:
            while not self._stop.is_set():
                chunk = os.pread(self._fd, _CHUNK, self._pos)
                if chunk:
                    self._pos += len(chunk)
                    with self._lock:
                        self._kept = (self._kept + chunk)[-KEEP_BYTES:]
                    self._write_on(chunk)
                    self._reclaim()
                    continue
                if os.fstat(self._fd).st_size < self._pos:  # emptied by an open with "w"
                    self._pos = self._freed = 0
                    continue
                if writers_gone:  # read to the end after the last writer's close
                    break
                self._reclaim_at_end()
                writers_gone = self._wait_for_writes()
        except OSError:  # the file removed under it: nothing more to pass on
            pass
        finally:
            self._close_fds()
            self.closed.set()

    def _close_fds(self) -> None:
        # Only by the thread that uses them (or before it started): an fd closed under a
        # read could be reused by another open meanwhile, and read from.
        for fd in (self._fd, self._notify):
            if fd is not None and fd >= 0:
                os.close(fd)
        self._fd, self._notify = -1, None

    def _wait_for_writes(self) -> bool:
        """Until the file may have grown; True once every writer is gone."""
        if self._notify is None:
            gone = self._process is None or self._process.poll() is not None
            if not gone:
                self._stop.wait(POLL_S)
            return gone
        if not select.select([self._notify], [], [], POLL_S)[0]:
            return False
        events = os.read(self._notify, 4096)
        offset = 0
        while offset < len(events):
            _, mask, _, name_len = _EVENT.unpack_from(events, offset)
            if mask & _IN_CLOSE_WRITE and not self._service_holds_it():
                return True
            offset += _EVENT.size + name_len
        return False

    def _service_holds_it(self) -> bool:
        """Whether the service still has the file as its stderr: a close seen meanwhile was
        another open file description's. Its exit closed its fds before its exit status can
        be read: then (or where /proc does not tell) False."""
        process = self._process
        if process is None or process.poll() is not None:
            return False
        try:
            held = os.stat(f"/proc/{process.pid}/fd/2")
        except OSError:
            return False
        mine = os.fstat(self._fd)
        return (held.st_dev, held.st_ino) == (mine.st_dev, mine.st_ino)

    def _write_on(self, chunk: bytes) -> None:
        # The launcher's stderr gone (a closed pipe) must not stop the reading: the file would
        # not be given back.
        try:
            while chunk:
                chunk = chunk[os.write(self._out, chunk):]
        except OSError:
            pass

    def _reclaim(self) -> None:
        """Punches a hole over what was passed on: the file keeps its length (the services'
        appends go on at its end) and gives its blocks back. Nothing is lost: only what was
        read is punched."""
        if not self._punch or self._pos - self._freed < RECLAIM_BYTES:
            return
        # From the start of the block holding ``_freed``: only whole blocks are given back, and
        # the one the last step ended in, read by now, was merely zeroed (a block kept per
        # step, 0.4% of all a service wrote, for its life).
        start = self._freed - self._freed % _BLOCK
        if _LIBC.fallocate(self._fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE,
                           start, self._pos - start) == 0:
            self._freed = self._pos
        elif ctypes.get_errno() in (errno.EOPNOTSUPP, errno.ENOSYS):
            self._punch = False  # this file system has no holes: emptied when read instead

    def _reclaim_at_end(self) -> None:
        # Without holes, the file is emptied once all of it was read. A line written between
        # the read that found the end and the truncation would be lost: the window is a
        # system call long, and holes, where the file system has them, have none.
        if self._punch or self._pos < RECLAIM_BYTES or os.fstat(self._fd).st_size != self._pos:
            return
        os.ftruncate(self._fd, 0)
        self._pos = self._freed = 0

    def last_lines(self, n: int = 3, wait_s: float = 0.0) -> list[str]:
        """The last ``n`` non-blank lines written so far, each cut to 300 characters; with
        ``wait_s``, first until every writer is gone and all was read, at most that long
        (once the service exited, its engine process may still be writing)."""
        if wait_s > 0:
            self.closed.wait(wait_s)
        with self._lock:
            text = self._kept.decode(errors="replace")
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
        return [ln if len(ln) <= 300 else ln[:297] + "..." for ln in lines[-n:]]

    def close(self, remove: bool = True) -> None:
        """Stops passing on (what a lingering writer writes from now on stays in the file)
        and, with ``remove``, removes the file."""
        self._stop.set()
        if self.write_fd >= 0:  # never started: no thread owns the fds
            os.close(self.write_fd)
            self.write_fd = -1
            self._close_fds()
            self.closed.set()
        elif self._thread is not threading.current_thread():
            # Out of its wait within POLL_S; one blocked passing on to a stderr nobody reads
            # is left to close its fds when it can.
            self._thread.join(POLL_S + 5.0)
        if remove:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
