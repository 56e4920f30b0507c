"""Ending a pdserve process whose work is done, without CPython's teardown."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading


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
