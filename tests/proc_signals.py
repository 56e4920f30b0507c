"""Stopping a child process for a test, knowing it is stopped, and waiting for a condition
(tests)."""
from __future__ import annotations

import os
import signal
import subprocess
import time


def stop_process(proc: subprocess.Popen) -> None:
    """SIGSTOPs ``proc`` and returns only once every one of its threads has stopped.

    ``kill`` returns as soon as the signal is queued. The kernel wakes one thread to start the
    group stop and tells the others only once that thread runs: on a loaded host that takes
    milliseconds, during which the other threads (a KV owner's UCX progress thread) keep
    serving. The parent is told when the last thread stopped: wait for that report, without
    reaping (``WNOWAIT``), so ``proc.wait`` still sees the exit later.
    """
    os.kill(proc.pid, signal.SIGSTOP)
    info = os.waitid(os.P_PID, proc.pid, os.WSTOPPED | os.WEXITED | os.WNOWAIT)
    if info.si_code != os.CLD_STOPPED:
        raise AssertionError(f"process {proc.pid} ended instead of stopping "
                             f"(si_code {info.si_code}, status {info.si_status})")


def reap(proc: subprocess.Popen, kill: bool = True) -> None:
    """Ends ``proc`` (SIGKILL unless ``kill`` is False: it is exiting by itself) and closes
    the pipes the test opened to it."""
    if kill and proc.poll() is None:
        proc.kill()
    proc.wait()
    for pipe in (proc.stdin, proc.stdout, proc.stderr):
        if pipe is not None:
            try:
                pipe.close()
            except OSError:  # a broken pipe's buffered write
                pass


def wait_until(pred, timeout_s: float = 30.0) -> bool:
    """Polls ``pred`` every 10 ms; whether it held before ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def alive(pid: int) -> bool:
    """``pid`` runs (or is stopped); a zombie, ended and only not yet reaped, does not."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def fd_targets() -> dict[str, str]:
    """This process's open fds and what each is (``socket:[inode]``, a path, ...)."""
    targets = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets[fd] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
    return targets


def tcp_rows() -> list[list[str]]:
    """The host's TCP sockets as /proc lists them (IPv4, then IPv6 where there is any): the
    columns of each row, local address 1, remote 2, state 3 ("0A": listening), inode 9."""
    rows = []
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows += [line.split() for line in f.readlines()[1:]]
        except FileNotFoundError:  # no IPv6
            continue
    return rows
