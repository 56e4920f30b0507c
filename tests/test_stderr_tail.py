"""router/stderr_tail.py: a launched service's stderr, passed on by the launcher."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from router.stderr_tail import PIPE_MAX_SIZE_FILE, StderrTail

pytestmark = pytest.mark.timeout(120)

# A service's burst of log lines: 512 KiB, then its exit.
_WRITER = ("import sys\n"
           "for i in range(8192):\n"
           "    sys.stderr.write(f'{i:08d} ' + 'x' * 54 + '\\n')\n"
           "sys.stderr.flush()\n")


def test_a_service_is_not_held_by_a_launcher_that_does_not_pass_its_lines_on():
    """The launcher's thread stuck on its own stderr (a pipe nobody reads here; `pdserve up`
    stopped by Ctrl-Z alike): the service's 64 KiB pipe filled and every later log line of
    the service blocked, on its event loop (the router stopped answering its health checks).
    Its stderr pipe now holds 1 MiB, so a 512 KiB burst goes through."""
    with open(PIPE_MAX_SIZE_FILE) as f:
        if int(f.read()) < 1 << 20:
            pytest.skip("this host's pipes hold less than 1 MiB (fs.pipe-max-size)")
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        service = subprocess.Popen([sys.executable, "-c", _WRITER], stderr=err_write)
    finally:
        os.close(err_write)
    tail = StderrTail(err_read, out_fd=out_write)
    try:
        assert service.wait(timeout=60) == 0  # it blocked in a write without the wider pipe
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
        os.close(out_read)  # the thread's write fails now: it reads on to the end
        assert tail.closed.wait(30)
        os.close(out_write)
    assert tail.last_lines(n=1) == [f"{8191:08d} " + "x" * 54]
