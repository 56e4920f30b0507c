"""Open file description locks (fcntl F_OFD_*): held per open file, not per process, and
dropped by the kernel when the last descriptor of it closes (its process dies). The core share
(engine/core_share.py) claims its slots with them, and ``pdserve up``'s sweep of dead
launchers' folders (router/share_dirs.py) asks whether anyone still holds one. No numpy or
torch here: the launcher's own process imports it.
"""
from __future__ import annotations

import fcntl
import os
import struct

# struct flock as fcntl(2) takes it (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len,
# l_pid (0 for an open file description's lock), padding.
_FLOCK = "hhqqi4x"


def ofd_lock(fd: int, cmd: int, lock_type: int, start: int, length: int) -> int:
    """One fcntl lock call (``cmd``: F_OFD_SETLK, F_OFD_GETLK, ...) on bytes [start,
    start + length) of ``fd`` (length 0: to the end); the l_type it returns (for F_OFD_GETLK,
    F_UNLCK when nobody holds a conflicting lock). Raises OSError as fcntl does."""
    got = fcntl.fcntl(fd, cmd, struct.pack(_FLOCK, lock_type, os.SEEK_SET, start, length, 0))
    return struct.unpack(_FLOCK, got)[0]
