"""The folders that hold a cluster's core-share file (engine/core_share.py), one per launcher,
and their removal: at the cluster's stop, at the launcher's exit, and, for a launcher that was
killed (SIGKILL, the OOM killer) and could do neither, by the next launcher on the machine.

Each folder is named after the pid of the launcher that made it. A sweep removes one only when
that pid is gone and no process holds a lock in its share file: every worker holds its slot's
lock for as long as it lives, so a folder whose launcher died under running workers stays until
they are gone too. Imports no numpy or torch: ``pdserve up``'s own process stays light.
"""
from __future__ import annotations

import atexit
import errno
import fcntl
import os
import shutil
import stat
import tempfile

from engine.ofd_locks import ofd_lock

PREFIX = "pdserve-cores-"
SHARE_FILE = "cores"

# The folders this process made and has not removed yet, with the pid that made each: a forked
# child that exits normally runs its parent's atexit hooks too, and must leave them.
LIVE: dict[str, int] = {}

def make() -> str:
    """A new folder for a cluster's share file, after sweeping those killed launchers left."""
    sweep()
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    LIVE[path] = os.getpid()
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    LIVE.pop(path, None)


@atexit.register
def remove_own() -> None:
    """A program that ends without stopping its cluster (an exception past a bare ``start()``,
    a test that drops one) still takes its folders with it."""
    for path, pid in list(LIVE.items()):
        if pid == os.getpid():
            remove(path)


def sweep(root: str | None = None) -> list[str]:
    """Removes the folders under ``root`` (the temp dir) that this user's dead launchers left
    and no process uses; returns them."""
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        path = os.path.join(root, name)
        if name.startswith(PREFIX) and _abandoned(path, name[len(PREFIX):]):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _abandoned(path: str, suffix: str) -> bool:
    maker = suffix.split("-", 1)[0]
    if not maker.isdigit() or suffix == maker:  # another program's name for its folder
        return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        return False
    return not _alive(int(maker)) and not _locked(os.path.join(path, SHARE_FILE))


def _alive(pid: int) -> bool:
    if pid <= 0:
        return True  # no launcher has it: leave the folder be
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM), or not to be told: alive
        return True
    return True


def _locked(path: str) -> bool:
    """Whether any process holds a lock anywhere in the file (a worker's slot); True where that
    cannot be told, so that nothing in use is removed. A missing file is not locked."""
    if not hasattr(fcntl, "F_OFD_GETLK"):
        return True
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    except OSError:
        return True
    try:
        return ofd_lock(fd, fcntl.F_OFD_GETLK, fcntl.F_WRLCK, 0, 0) != fcntl.F_UNLCK
    except OSError as e:
        return e.errno != errno.ENOENT
    finally:
        os.close(fd)
