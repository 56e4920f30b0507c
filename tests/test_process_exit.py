"""A service process that ends with a status skips the interpreter's teardown.

A daemon thread still blocked in a native call when the process ends (a KV pull's join left
behind by a stopped owner sits in torch's TCPStore or gloo constructor) must not return into
the teardown: CPython ends it there with ``pthread_exit``, and through C++ frames that is
``std::terminate``. A worker whose engine died then ended by SIGABRT, not with the status its
supervisor restarts it on.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.process_exit import describe_exit, exit_status

ROOT = Path(__file__).resolve().parent.parent

# A daemon thread blocked in a TCPStore wait, released by a finalizer that only the teardown
# runs: the wait returns into an interpreter that is finalizing (deterministically: before
# the fix this aborted in every run). The thread's target is the C++ method itself, so no
# frame of it holds the script's globals alive past the teardown's clearing of them.
_BLOCKED_THREAD = textwrap.dedent("""
    import datetime, socket, sys, threading, time
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=30)
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timeout)
    waiter = dist.TCPStore("127.0.0.1", server.port, 1, False, timeout=timeout)

    class ReleaseInTeardown:
        # Bound now: the teardown empties the module's names before it gets here.
        def __del__(self, release=server.set, sleep=time.sleep):
            release("go", b"1")
            sleep(1)

    hook = ReleaseInTeardown()
    threading.Thread(target=waiter.wait, args=(["go"],), daemon=True).start()
    code = sys.argv[1]
    """)

# A service (engine.grpc_server.run) whose main ends with SystemExit(code).
_SERVICE = _BLOCKED_THREAD + textwrap.dedent("""
    from engine.grpc_server import run

    async def main():
        raise SystemExit(int(code) if code.isdigit() else code)

    run(main)
    """)

# An engine process (engine/engine_proc.py) whose serving fails.
_ENGINE_PROCESS = _BLOCKED_THREAD + textwrap.dedent("""
    import engine.engine_proc as engine_proc

    async def failing_serve(reader, writer):
        raise RuntimeError(code)

    engine_proc._serve = failing_serve
    down, up = socket.socketpair()
    engine_proc.main(down.detach(), up.detach())
    """)


def _run_script(tmp_path, text: str, arg: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(text)
    return subprocess.run([sys.executable, str(script), arg], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("code, status", [("the engine died", 1), ("3", 3), ("0", 0)])
def test_a_service_ending_with_a_status_skips_the_teardown(tmp_path, code, status):
    proc = _run_script(tmp_path, _SERVICE, code)
    # Through the teardown: SIGABRT ("terminate called without an active exception").
    assert proc.returncode == status, proc.stderr
    assert "terminate called" not in proc.stderr
    if status == 1:
        assert proc.stderr.strip().endswith("the engine died")


def test_a_failing_engine_process_skips_the_teardown(tmp_path):
    proc = _run_script(tmp_path, _ENGINE_PROCESS, "the model would not load")
    assert proc.returncode == 1, proc.stderr
    assert "terminate called" not in proc.stderr
    assert "RuntimeError: the model would not load" in proc.stderr  # its traceback


# A service's stop asked before it serves (engine/process_exit.py's record_stop_signals), then
# asked again.
_TWO_STOPS = textwrap.dedent("""
    import os, signal, sys
    from engine.process_exit import record_stop_signals, stop_asked

    record_stop_signals()
    sig = getattr(signal, sys.argv[1])
    os.kill(os.getpid(), sig)
    print(stop_asked.is_set(), flush=True)
    os.kill(os.getpid(), sig)
    print("still running", flush=True)
    """)


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_first_stop_is_recorded_and_a_second_ends_the_process(tmp_path, sig):
    proc = _run_script(tmp_path, _TWO_STOPS, sig)
    assert proc.stdout == "True\n", proc.stderr
    assert proc.returncode == -getattr(signal, sig)


def test_exit_status_follows_sys_exit():
    assert exit_status(None) == 0
    assert exit_status(2) == 2
    assert exit_status(256 + 7) == 7  # what the OS keeps of it
    assert exit_status("a message") == 1


def test_a_childs_exit_reads_as_its_status_or_its_signal():
    assert describe_exit(0) == "exit status 0"
    assert describe_exit(3) == "exit status 3"
    assert describe_exit(-signal.SIGKILL) == f"killed by signal {int(signal.SIGKILL)} (SIGKILL)"
    assert describe_exit(-200) == "killed by signal 200"  # no such signal: its number
    assert describe_exit(None) == "still running"
