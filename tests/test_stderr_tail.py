"""router/stderr_tail.py: a launched service's stderr, a file the launcher passes on, with real
processes: a stopped launcher holds no service, a killed one loses none of its last lines."""
from __future__ import annotations

import os
import pathlib
import select
import signal
import subprocess
import sys

import pytest

from router.stderr_tail import RECLAIM_BYTES, StderrTail
from tests.proc_signals import reap, stop_process

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[1]
LINES = 65536  # 4 MiB of 64-byte lines: four times the widest pipe the launcher had
LINE = "{:08d} " + "x" * 54 + "\n"

# A service's burst of log lines, once the test says go (the launcher stopped by then).
_WRITER = f"""
import sys
with open(sys.argv[1]) as go:
    go.read()
for i in range({LINES}):
    sys.stderr.write({LINE!r}.format(i))
sys.stderr.flush()
"""

# A launcher: the service started as Cluster._spawn starts one, its stderr passed on to ours.
_LAUNCHER = f"""
import subprocess, sys
from router.stderr_tail import StderrTail
tail = StderrTail(sys.argv[1])
service = subprocess.Popen([sys.executable, "-c", {_WRITER!r}, sys.argv[2]],
                           stderr=tail.write_fd)
tail.started(service)
print(service.pid, flush=True)
service.wait()
print(tail.last_lines(n=1, wait_s=60)[0], flush=True)
"""

# A service that stops as the launcher dies (its lifeline's end of file), saying so.
_STOPPING = """
import sys
sys.stdin.read()
sys.stderr.write("pdserve: stopping: the launcher is gone\\n")
"""


def _wait_exit(pid: int, timeout_s: float) -> bool:
    """Whether process ``pid`` (not our child) exited within ``timeout_s``."""
    fd = os.pidfd_open(pid)
    try:
        return bool(select.select([fd], [], [], timeout_s)[0])
    finally:
        os.close(fd)


def test_a_stopped_launcher_holds_no_service(tmp_path):
    """The launcher read each service's stderr from a pipe: stopped (SIGSTOP; Ctrl-Z with its
    services in sessions of their own), it left the service blocked in its log line once the
    pipe was full (1 MiB), on its event loop (requests hung). The service now writes to a
    file: its 4 MiB go through while the launcher is stopped, the launcher passes them all on
    once it runs again, quotes the last line, and gives the file's blocks back as it reads."""
    log, out, go = tmp_path / "service.log", tmp_path / "launcher.err", tmp_path / "go"
    os.mkfifo(go)
    with open(out, "wb") as err:
        launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(log), str(go)],
                                    cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
    try:
        service_pid = int(launcher.stdout.readline())
        stop_process(launcher)
        try:
            with open(go, "w") as f:
                f.write("go")
            # Blocked in a write without the fix: it would never exit.
            assert _wait_exit(service_pid, 60), "the service stalled behind the launcher"
        finally:
            os.kill(launcher.pid, signal.SIGCONT)
        assert launcher.stdout.readline().decode().strip() == LINE.format(LINES - 1).strip()
        assert launcher.wait(timeout=60) == 0
    finally:
        reap(launcher)
    expected = "".join(LINE.format(i) for i in range(LINES)).encode()
    assert out.read_bytes() == expected  # passed on whole, in order
    st = os.stat(log)
    assert st.st_size == len(expected)
    # What was passed on was given back: at most the last step's worth is still held.
    assert st.st_blocks * 512 <= RECLAIM_BYTES + 65536, st.st_blocks


def test_a_killed_launcher_leaves_the_services_last_lines_in_their_file(tmp_path):
    """Its pipe's reader gone with it, what a service wrote as it stopped for the launcher's
    death (SIGKILL, the OOM killer) was lost; it stays in the service's file now."""
    log = tmp_path / "service.log"
    launcher_code = f"""
import subprocess, sys
from router.stderr_tail import StderrTail
tail = StderrTail(sys.argv[1])
service = subprocess.Popen([sys.executable, "-c", {_STOPPING!r}], stdin=subprocess.PIPE,
                           stderr=tail.write_fd)
tail.started(service)
print(service.pid, flush=True)
service.wait()
"""
    launcher = subprocess.Popen([sys.executable, "-c", launcher_code, str(log)], cwd=ROOT,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        service_pid = int(launcher.stdout.readline())
        launcher.kill()
        launcher.wait()
        assert _wait_exit(service_pid, 60)
    finally:
        reap(launcher)
    assert log.read_bytes().endswith(b"pdserve: stopping: the launcher is gone\n")


def test_the_last_lines_wait_for_what_the_service_started(tmp_path):
    """An engine process (a TP rank) shares its worker's stderr and may write after the worker
    exited: its lines are quoted too, once the last of them closed the file."""
    grandchild = "import sys; sys.stdin.read(); sys.stderr.write('engine: gone too\\n')"
    service_code = ("import subprocess, sys\n"
                    f"subprocess.Popen([sys.executable, '-c', {grandchild!r}], "
                    "stdin=subprocess.PIPE)\n"
                    "sys.stderr.write('worker: exiting\\n')\n")
    out_read, out_write = os.pipe()
    tail = StderrTail(str(tmp_path / "service.log"), out_fd=out_write)
    try:
        service = subprocess.Popen([sys.executable, "-c", service_code], stderr=tail.write_fd)
        tail.started(service)
        assert service.wait(timeout=60) == 0
        assert tail.last_lines(n=2, wait_s=60) == ["worker: exiting", "engine: gone too"]
        assert tail.closed.is_set()
    finally:
        tail.close()
        os.close(out_write)
        with os.fdopen(out_read, "rb") as f:
            assert f.read() == b"worker: exiting\nengine: gone too\n"
    assert not (tmp_path / "service.log").exists()


def test_without_inotify_or_holes_the_file_is_emptied_once_passed_on(tmp_path, monkeypatch):
    """Not Linux, or a file system without holes: the service's exit stands for its last
    writer's close, and the file, read to its end, is emptied rather than punched."""
    from router import stderr_tail

    monkeypatch.setattr(stderr_tail, "_LIBC", None)
    log = tmp_path / "service.log"
    with open(tmp_path / "out", "wb") as out:
        tail = StderrTail(str(log), out_fd=out.fileno())
        try:
            writer = _WRITER.replace("with open(sys.argv[1]) as go:\n    go.read()\n", "")
            service = subprocess.Popen([sys.executable, "-c", writer], stderr=tail.write_fd)
            assert service.wait(timeout=60) == 0  # all written before the reading starts
            tail.started(service)
            assert tail.last_lines(n=1, wait_s=60) == [LINE.format(LINES - 1).strip()]
            assert tail.closed.is_set()
            assert log.stat().st_size == 0
        finally:
            tail.close()
    assert (tmp_path / "out").read_bytes() == "".join(LINE.format(i)
                                                       for i in range(LINES)).encode()


def _read_until(fd: int, end: bytes, timeout_s: float = 60.0) -> bytes:
    """What comes through pipe ``fd`` until it ends with ``end`` (nothing more is written
    meanwhile); what came by then if it does not within ``timeout_s``."""
    got = b""
    while not got.endswith(end) and select.select([fd], [], [], timeout_s)[0]:
        got += os.read(fd, 65536)
    return got


def test_a_child_that_opens_dev_stderr_does_not_end_the_passing_on(tmp_path):
    """A process that opens /dev/stderr anew has a description of its own, whose close inotify
    reports as IN_CLOSE_WRITE too: the launcher took it for the last writer's and passed
    nothing the service wrote after it on, for the service's life. Opened "w", it also
    empties the file: the reading goes on from its start."""
    service_code = ("import sys\n"
                    "sys.stderr.write('worker: starting\\n'); sys.stderr.flush()\n"
                    "sys.stdin.readline()\n"
                    "with open('/dev/stderr', 'w') as f:\n"
                    "    f.write('child: own\\n')\n"
                    "sys.stdin.readline()\n"
                    "sys.stderr.write('worker: still here\\n')\n")
    out_read, out_write = os.pipe()
    tail = StderrTail(str(tmp_path / "service.log"), out_fd=out_write)
    try:
        service = subprocess.Popen([sys.executable, "-c", service_code], stderr=tail.write_fd,
                                   stdin=subprocess.PIPE)
        tail.started(service)
        try:
            assert _read_until(out_read, b"worker: starting\n") == b"worker: starting\n"
            service.stdin.write(b"\n")
            service.stdin.flush()
            assert _read_until(out_read, b"child: own\n") == b"child: own\n"
            service.stdin.write(b"\n")
            service.stdin.close()
            assert service.wait(timeout=60) == 0
        finally:
            reap(service)
        assert tail.last_lines(n=1, wait_s=60) == ["worker: still here"]
        assert _read_until(out_read, b"\n") == b"worker: still here\n"
    finally:
        tail.close()
        os.close(out_write)
        os.close(out_read)


def test_a_punch_gives_back_the_block_the_last_one_ended_in(tmp_path, monkeypatch):
    """Holes are punched over whole blocks only: each punch from where the last ended, in
    the middle of a block, left that block (read, zeroed) on disk for the file's life, a
    block per step (0.4% of all a service wrote at the 1 MiB step; all of it here)."""
    from router import stderr_tail

    if stderr_tail._LIBC is None:
        pytest.skip("no fallocate: not Linux")
    monkeypatch.setattr(stderr_tail, "RECLAIM_BYTES", 8192)
    log = tmp_path / "service.log"
    out_read, out_write = os.pipe()
    tail = StderrTail(str(log), out_fd=out_write)
    writer = os.dup(tail.write_fd)  # the service: this test
    tail.started(None)
    burst = b"y" * 10_001  # ends in the middle of a block, as a log line does
    try:
        for _ in range(200):
            os.write(writer, burst)
            assert _read_until(out_read, burst) == burst
        os.close(writer)
        assert tail.closed.wait(60)
    finally:
        tail.close(remove=False)
        os.close(out_write)
        os.close(out_read)
    st = os.stat(log)
    assert st.st_size == 200 * len(burst)
    # What was not punched yet: less than a step, and the blocks either side of it.
    assert st.st_blocks * 512 <= 8192 + 2 * 4096, st.st_blocks
