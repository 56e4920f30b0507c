"""Ending a pdserve process whose work is done, without CPython's teardown."""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import signal
import sys
import threading

_PR_SET_PDEATHSIG = 1


def exit_process() -> None:
    """Ends the process as the interpreter would, less its teardown.

    Non-daemon threads are joined and exit handlers and finalizers run (a TP engine's ranks
    are stopped there), stdio is flushed; what is skipped is CPython freeing every module's
    objects one by one, with full collections over torch's, transformers' and gRPC's heaps:
    ~1 s of CPU in a process that loaded a model, on the 2-core VM. A service paid it at every
    stop (a cluster's three at once took 2.3-2.8 s to exit with nothing in flight, nearly all
    of it there); a tensor-parallel rank or an engine process pays it while its parent waits
    for it to exit. Callers bound the joins themselves (grpc_server's exit watchdog; a rank's
    parent kills a rank that does not quit in time)."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what the interpreter calls
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe must not change it
            stream.flush()
    os._exit(0)


def die_with_parent(parent_pid: int) -> None:
    """Has the kernel SIGKILL this process when ``parent_pid`` (its parent) ends, however it
    ends: a child stopped or wedged cannot notice by itself (an engine process SIGSTOPped when
    its worker was SIGKILLed outlived both). The signal follows the parent's thread that
    started the child, so the parent passes 0 (nothing done) unless that was its main thread.
    Linux only; elsewhere nothing happens."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the pipe's end still stops it
        return
    if os.getppid() != parent_pid:  # it ended before the request: nothing will signal
        os._exit(1)


def parent_pid_for_child() -> int:
    """What a child started now passes to ``die_with_parent``: this pid, or 0 when this is not
    the main thread (its end would kill the child)."""
    return os.getpid() if threading.current_thread() is threading.main_thread() else 0
