"""Leaves a trace of a pytest process that dies by a signal, for `make test` to print.

CI shows only the tail of a run. When a native library aborts the process (gloo, UCX, gRPC's
core), faulthandler's dump of every thread scrolls the interesting part (which test, which of our
frames) out of that tail, and the process can run no code of its own after the signal. So, when
PDSERVE_CRASH_LOG names a folder, the dump goes to a file there and each test's id is written
down as it starts; `tests/crash_report.py` prints both, condensed, after pytest has died.
"""
import faulthandler
import os
import sys
from pathlib import Path

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
    """A session that ends on its own leaves no trace: the report then has nothing to say."""
    if not _state:
        return
    faulthandler.enable(file=sys.__stderr__, all_threads=True)
    os.close(_state.pop("current_fd"))
    _state.pop("faults").close()
    path = _state.pop("path")
    for name in (FAULTS_FILE, CURRENT_FILE):
        (path / name).unlink(missing_ok=True)

