"""Threads whose OS names match their Python names, so ``top -H``, ``ps -L``, py-spy and
``/proc/PID/task/*/comm`` tell a worker's engine thread from its event loop and its KV
progress thread (CPython before 3.14 leaves every thread named after the process)."""
from __future__ import annotations

import ctypes
import functools
import sys
import threading
from collections.abc import Callable

_PR_SET_NAME = 15
_MAX_BYTES = 15  # the kernel's limit; longer names are cut
_PREFIX = "pdserve-"  # every thread of a pdserve process is pdserve's: the OS name skips it


def os_thread_name(name: str) -> str:
    """What the kernel is told for ``name``: without the prefix, at most 15 bytes."""
    short = name[len(_PREFIX):] if name.startswith(_PREFIX) else name
    return short.encode()[:_MAX_BYTES].decode(errors="ignore") or "pdserve"


def set_os_thread_name(name: str) -> None:
    """Names the calling thread for the OS (Linux; elsewhere nothing happens)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        _libc().prctl(_PR_SET_NAME, ctypes.c_char_p(os_thread_name(name).encode()), 0, 0, 0)
    except (OSError, AttributeError):  # no prctl here: the name is a convenience
        pass


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def named_thread(target: Callable[..., object], name: str, args: tuple = (),
                 daemon: bool = True) -> threading.Thread:
    """A (not yet started) thread called ``name`` in Python and, once running, in the OS."""
    def run() -> None:
        set_os_thread_name(name)
        target(*args)

    return threading.Thread(target=run, name=name, daemon=daemon)
