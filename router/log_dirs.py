"""The folders of a cluster's stderr files (router/stderr_tail.py), one per launcher: removed at
the cluster's stop or the launcher's exit. One whose launcher was killed (SIGKILL, the OOM
killer) stays, for what the services wrote as they stopped for its death; its files' blocks
are those the launcher had not passed on yet. Imports no numpy or torch."""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile

PREFIX = "pdserve-logs-"

# The folders this process made and has not removed yet, with the pid that made each: a forked
# child that exits normally runs its parent's atexit hooks too, and must leave them.
LIVE: dict[str, int] = {}


def make() -> str:
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    LIVE[path] = os.getpid()
    return path


def remove(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    LIVE.pop(path, None)


@atexit.register
def remove_own() -> None:
    """A program that ends without stopping its cluster still takes its folders with it."""
    for path, pid in list(LIVE.items()):
        if pid == os.getpid():
            remove(path)
