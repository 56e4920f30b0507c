"""A service's process family: the processes it started (a prefill worker's TP ranks), found
through Linux's /proc children lists and held by pidfd, so that stopping the service stops
them too, even once their pids could be reused."""
from __future__ import annotations

import os
import signal


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux's /proc children lists)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        try:
            tids = os.listdir(f"/proc/{parent}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{parent}/task/{tid}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:  # the thread or process ended meanwhile
                continue
            found += kids
            todo += kids
    return found


def pin_family(proc) -> None:
    """Holds a pidfd to each process the service started, while they are still its children:
    a signal through a pidfd reaches that process even once its pid is reused."""
    if proc.family is not None:
        return
    proc.family = []
    if proc.popen.poll() is not None:
        return
    for pid in descendants(proc.popen.pid):
        try:
            proc.family.append(os.pidfd_open(pid))
        except OSError:  # it ended meanwhile
            pass


def kill_family(proc) -> None:
    for fd in proc.family or []:
        try:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        except ProcessLookupError:  # it exited (its parent stopped it): the usual case
            pass
        finally:
            os.close(fd)
    proc.family = []
