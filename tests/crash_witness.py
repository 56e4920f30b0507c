"""Leaves a trace of a pytest process that dies by a signal, for `make test` to print.

CI shows only the tail of a run. When a native library aborts the process (gloo, UCX, gRPC's
core), faulthandler's dump of every thread scrolls the interesting part (which test, which of our
frames) out of that tail, and the process can run no code of its own after the signal. So, when
PDSERVE_CRASH_LOG names a folder, the dump goes to a file there and each test's id is written
down as it starts; `tests/crash_report.py` prints both, condensed, after pytest has died by a
signal (it is told pytest's exit status).
"""
import faulthandler
import os
from pathlib import Path

import pytest

CRASH_LOG_ENV = "PDSERVE_CRASH_LOG"
FAULTS_FILE = "faults.log"
CURRENT_FILE = "current-test"

_state: dict = {}


def pytest_sessionstart(session):
    folder = os.environ.get(CRASH_LOG_ENV)
    if not folder:
        return
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    faults = open(path / FAULTS_FILE, "w")
    # After pytest's own faulthandler plugin (pytest_configure): this replaces its stderr target.
    faulthandler.enable(file=faults, all_threads=True)
    current_fd = os.open(path / CURRENT_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    _state.update(path=path, faults=faults, current_fd=current_fd)


def pytest_runtest_logstart(nodeid, location):
    fd = _state.get("current_fd")
    if fd is None:
        return
    data = nodeid.encode()
    os.pwrite(fd, data, 0)
    os.ftruncate(fd, len(data))


def pytest_sessionfinish(session, exitstatus):
    """The trace stays on through interpreter exit, where a native thread can still abort the
    process (tests/crash_report.py prints it only for a pytest that a signal ended)."""
    fd = _state.get("current_fd")
    if fd is not None:
        data = b"(none: the session had finished, the interpreter was exiting)"
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    # After pytest's faulthandler plugin, which disables the handler on its way out.
    faults = _state.get("faults")
    if faults is not None:
        faulthandler.enable(file=faults, all_threads=True)
