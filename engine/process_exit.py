"""Ending a pdserve process whose work is done, without CPython's teardown."""
from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import ctypes
import os
import queue
import signal
import subprocess
import sys
import threading

_PR_SET_PDEATHSIG = 1

# Set by SIGTERM or SIGINT once record_stop_signals ran: a stop asked before the service could
# take it the usual way (engine/grpc_server.py), e.g. while a worker loads its model.
stop_asked = threading.Event()


def record_stop_signals() -> None:
    """From a service process's start: SIGTERM and SIGINT set ``stop_asked`` rather than end
    the process by their default action. Killed so while its model loaded, a worker exited with
    -15, which ``pdserve up``'s supervisor took for a crash: it started the worker again and
    counted it against --max-restarts. The service checks the flag once it can, and exits 0
    without serving. A second signal ends it at once, as the first did: a load can take
    minutes, which whoever asks twice will not wait for."""
    def asked(sig: int, _frame) -> None:
        if stop_asked.is_set():
            signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), sig)
        stop_asked.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, asked)


def exit_process(status: int = 0) -> None:
    """Ends the process with ``status`` as the interpreter would, less its teardown.

    Non-daemon threads are joined and exit handlers and finalizers run (a TP engine's ranks
    are stopped there), stdio is flushed; what is skipped is CPython freeing every module's
    objects one by one, with full collections over torch's, transformers' and gRPC's heaps:
    ~1 s of CPU in a process that loaded a model, on the 2-core VM. A service paid it at every
    stop (a cluster's three at once took 2.3-2.8 s to exit with nothing in flight, nearly all
    of it there); a tensor-parallel rank or an engine process pays it while its parent waits
    for it to exit. Callers bound the joins themselves (grpc_server's exit watchdog; a rank's
    parent kills a rank that does not quit in time).

    The teardown is also where a daemon thread still blocked in a native call dies badly: one
    that returns into Python there is ended by ``pthread_exit``, and through C++ frames (a
    torch TCPStore or gloo constructor a KV pull abandoned) that unwinding is
    ``std::terminate``, SIGABRT instead of the status asked for."""
    shutdown_threads = getattr(threading, "_shutdown", None)  # what the interpreter calls
    if shutdown_threads is not None:
        shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed or broken pipe must not change it
            stream.flush()
    os._exit(status)


def exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends a process with; a code that is not an int or None is
    written to stderr first, as the interpreter does."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    with contextlib.suppress(Exception):
        print(code, file=sys.stderr)
    return 1


def die_with_parent(parent_pid: int) -> None:
    """Has the kernel SIGKILL this process when ``parent_pid`` (its parent) ends, however it
    ends: a child stopped or wedged cannot notice by itself (an engine process SIGSTOPped when
    its worker was SIGKILLed outlived both). The signal follows the parent's thread that
    started the child, so the parent starts it with ``popen_tied``. 0: nothing done.
    Linux only; elsewhere nothing happens."""
    if not parent_pid or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl: the pipe's end still stops it
        return
    if os.getppid() != parent_pid:  # it ended before the request: nothing will signal
        os._exit(1)


def describe_exit(code: int | None) -> str:
    """A child's exit status in words: "exit status 1", "killed by signal 9 (SIGKILL)"."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exit status {code}"
    try:
        name = signal.Signals(-code).name
    except ValueError:
        return f"killed by signal {-code}"
    return f"killed by signal {-code} ({name})"


class _Spawner:
    """Starts child processes on one thread that lives as long as the process.

    PR_SET_PDEATHSIG fires when the *thread* that forked the child ends, not the process: a
    child started from an executor's or asyncio.to_thread's thread would be killed when that
    thread retires, so such children could not use die_with_parent at all (a TP rank, started
    while its engine is built on a pool thread, outlived its SIGKILLed parent when stopped)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        with self._lock:
            # Also after a fork: the child process has none of the parent's threads.
            if self._thread is None or not self._thread.is_alive():
                # Daemon: never joined at exit, so it outlives every thread that joins.
                self._thread = threading.Thread(target=self._run, name="pdserve-spawner",
                                                daemon=True)
                self._thread.start()
        job: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((job, argv, kwargs))
        return job.result()

    def _run(self) -> None:
        while True:
            job, argv, kwargs = self._jobs.get()
            try:
                job.set_result(subprocess.Popen(argv, **kwargs))
            except BaseException as e:  # noqa: BLE001 - the caller's to handle
                job.set_exception(e)


_spawner = _Spawner()


def popen_tied(argv: list[str], **kwargs) -> subprocess.Popen:
    """``subprocess.Popen(argv, **kwargs)`` for a child that calls ``die_with_parent`` with
    this process's pid (``os.getpid()``), from whichever thread."""
    return _spawner.popen(argv, **kwargs)
