"""The folders of a cluster's stderr files (router/stderr_tail.py), one per launcher: removed at
the cluster's stop or the launcher's exit. One whose launcher was killed (SIGKILL, the OOM
killer) stays, for what the services wrote as they stopped for its death; its files' blocks
are those the launcher had not passed on yet. Kept and removed as the core-share folders are
(router/share_dirs.py: its registry and exit hook), but never swept: what a killed launcher's
services last wrote is for its user to read. Imports no numpy or torch."""
from __future__ import annotations

import os
import tempfile

from router import share_dirs

PREFIX = "pdserve-logs-"


def make() -> str:
    path = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    share_dirs.LIVE[path] = os.getpid()  # share_dirs' exit hook removes it with its own
    return path


remove = share_dirs.remove
