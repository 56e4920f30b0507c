"""Stopping a service leaves none of the processes it started behind: not when it is killed
past its grace, not when it exits and forgets one (a TP worker its rank 0 could not stop)."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from router import log_dirs, share_dirs
from router.launcher import Cluster, ClusterSpec, Proc

pytestmark = pytest.mark.timeout(60)

# A service that starts a child (its "TP worker") and stops it, then prints both pids.
_SERVICE = textwrap.dedent("""
    import faulthandler, signal, subprocess, sys, time
    faulthandler.register(signal.SIGUSR1)  # as every service does (engine.grpc_server.run)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    child.send_signal(signal.SIGSTOP)  # wedged: it would not even see its parent go
    {on_term}
    print(child.pid, flush=True)
    time.sleep(600)
""")
_STUCK = "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a shutdown that never ends"
_FORGETFUL = "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # exits, child left over"


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for init to reap it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


@pytest.mark.parametrize("on_term, code", [(_STUCK, -9), (_FORGETFUL, 0)],
                         ids=["stuck-past-its-grace", "exits-and-forgets-it"])
def test_stopping_a_service_kills_what_it_left_behind(on_term, code):
    popen = subprocess.Popen([sys.executable, "-c", _SERVICE.format(on_term=on_term)],
                             stdout=subprocess.PIPE, text=True)
    child = int(popen.stdout.readline())
    try:
        cluster = Cluster(ClusterSpec())
        proc = Proc("service", "127.0.0.1:0", popen)
        cluster.procs.append(proc)
        assert cluster.stop_proc(proc, grace_s=2.0) == code
        assert _wait_gone(child), "the service's child outlived it"
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()
        if not _gone(child):
            os.kill(child, signal.SIGKILL)


# A service whose work is done but whose loop executor still has a thread blocked (as one waiting
# on the lock of an engine that died under it would be): asyncio would join it forever.
_BLOCKED_EXECUTOR = textwrap.dedent("""
    import asyncio, threading
    from engine.grpc_server import run
    async def main():
        asyncio.get_running_loop().run_in_executor(None, threading.Event().wait)
        await asyncio.sleep(0.1)
        {after}
    run(main)
""")


@pytest.mark.parametrize("after, code", [
    ("pass", 1), pytest.param("raise SystemExit(3)", 1, marks=pytest.mark.slow)],
    ids=["returned", "raised"])
def test_a_thread_left_blocked_does_not_hold_the_exit(after, code):
    proc = subprocess.run([sys.executable, "-c", _BLOCKED_EXECUTOR.format(after=after)],
                          capture_output=True, text=True, timeout=45)
    assert proc.returncode == code
    assert "has not exited" in proc.stderr
    assert "Event().wait" in proc.stderr or "threading.py" in proc.stderr  # the stacks


def test_a_clean_service_exits_at_once_with_its_status():
    code = "from engine.grpc_server import run\nasync def main(): pass\nrun(main)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=45)
    assert proc.returncode == 0 and "has not exited" not in proc.stderr


# A service that stopped ends without the interpreter's teardown (CPython freeing every module's
# objects, over a second of CPU in a worker), but as a process that exits normally would: its
# non-daemon threads finish, its exit handlers run, what it printed without a flush arrives.
_ENDING = textwrap.dedent("""
    import atexit, threading, time
    from engine.grpc_server import run

    class FreedAtTeardown:
        def __del__(self):
            print("torn down", flush=True)

    kept = FreedAtTeardown()  # a module global: freed only by the interpreter's teardown
    def late():
        time.sleep(0.3)
        print("thread done", end=" ")
    async def main():
        atexit.register(lambda: print("exit handler", end=" "))
        threading.Thread(target=late).start()
        print("served", end=" ")
    run(main)
""")


def test_a_stopped_service_ends_as_an_exit_would_less_the_teardown():
    proc = subprocess.run([sys.executable, "-c", _ENDING], capture_output=True, text=True,
                          timeout=45)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["served", "thread", "done", "exit", "handler"]


# A launcher that starts a real cluster, prints its services' pids and redis', then waits.
_LAUNCHER = textwrap.dedent("""
    import json, time
    from router.launcher import Cluster, ClusterSpec
    from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS
    cluster = Cluster(ClusterSpec(model=SERVING_MODEL, worker_args=WORKER_ARGS,
                                  drain_timeout_s=2.0)).start()
    print(json.dumps({"services": [p.popen.pid for p in cluster.procs],
                      "redis": cluster.redis.proc.pid, "share_dir": cluster._share_dir,
                      "log_dir": cluster.log_dir}),
          flush=True)
    time.sleep(600)
""")


@pytest.mark.timeout(180)
def test_a_killed_launcher_leaves_no_service_behind():
    import json

    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER], stdout=subprocess.PIPE,
                                text=True)
    pids = {}
    try:
        # The services print to the stdout they inherit too.
        line = next(line for line in launcher.stdout if line.startswith("{"))
        pids = json.loads(line)
        assert len(pids["services"]) == 3  # router, prefill, decode
        launcher.kill()  # no SIGTERM for it to stop them by: SIGKILL, as the OOM killer does
        launcher.wait()
        # Each drains (nothing in flight) and exits as on SIGTERM; the kernel stops redis.
        deadline = time.monotonic() + 60.0
        left = [pid for pid in [*pids["services"], pids["redis"]]
                if not _wait_gone(pid, max(0.0, deadline - time.monotonic()))]
        assert not left, f"processes {left} of {pids} outlived their launcher"
        # What each wrote as it stopped stays in its stderr file, with no launcher to pass
        # it on (a pipe's reader, it took those lines with it).
        logs = [(pathlib.Path(pids["log_dir"]) / name).read_bytes()
                for name in sorted(os.listdir(pids["log_dir"]))]
        assert len(logs) == 3
        assert all(b"the launcher that started this service is gone: stopping" in log
                   for log in logs), [log[-300:] for log in logs]
        # Its core-share folder it could not remove: the next launcher's sweep does.
        share_dir = pids["share_dir"]
        assert os.path.isdir(share_dir)
        assert share_dir in share_dirs.sweep(os.path.dirname(share_dir))
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in [*pids.get("services", []), pids.get("redis")]:
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        if pids.get("share_dir"):
            share_dirs.remove(pids["share_dir"])
        if pids.get("log_dir"):
            log_dirs.remove(pids["log_dir"])


@pytest.mark.timeout(180)
def test_a_stopping_router_sends_new_requests_elsewhere_and_finishes_its_own():
    """From SIGTERM on, a router reports NOT_SERVING and answers new requests UNAVAILABLE (the
    SDK's failover takes them to another router), while those in flight run to their end."""
    import threading

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from client import Client, FailoverPolicy, UnavailableError
    from tests.serving_helpers import SERVING_MODEL, WORKER_ARGS, random_prompts

    # A drain long enough for the stream on a loaded host: the test is about who is served.
    cluster = Cluster(ClusterSpec(model=SERVING_MODEL, worker_args=WORKER_ARGS,
                                  drain_timeout_s=120.0)).start()
    try:
        (router,) = [p for p in cluster.procs if p.name == "router"]
        prompt = random_prompts(1, seed=9, lo=40, hi=40)[0]
        client = Client(router.address, timeout=120, failover=FailoverPolicy(max_retries=0))
        chunks: list = []
        first, done = threading.Event(), threading.Event()

        def stream():
            try:
                for chunk in client.generate(prompt, max_tokens=200, temperature=0.0,
                                             ignore_eos=True):
                    chunks.append(chunk)
                    first.set()
            finally:
                done.set()

        streaming = threading.Thread(target=stream)
        streaming.start()
        assert first.wait(60)
        router.popen.send_signal(signal.SIGTERM)
        with grpc.insecure_channel(router.address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            deadline = time.monotonic() + 20
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                    health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline
                time.sleep(0.02)
        assert not done.is_set(), "the stream ended before the test could ask"
        with pytest.raises(UnavailableError, match="shutting down"):
            client.complete(prompt, max_tokens=2)
        streaming.join(120)
        assert sum(len(c.token_ids) for c in chunks) == 200
        assert chunks[-1].finish_reason == "length"
        client.close()
    finally:
        cluster.stop()


@pytest.mark.timeout(180)
def test_pdserve_up_stops_at_once_when_told_to_while_starting():
    """SIGTERM before the services are up (a large model loading): ``pdserve up`` stops what
    it started then, instead of waiting for every service to come up first."""
    from tests.proc_signals import wait_until

    up = subprocess.Popen([sys.executable, "-m", "engine.cli", "up", "--model", "tiny-llama"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)
    try:
        # Its services are starting: a process of its own each, none serving yet.
        assert wait_until(lambda: len(_children(up.pid)) >= 3, 60)
        services = _children(up.pid)
        up.send_signal(signal.SIGTERM)
        out, err = up.communicate(timeout=120)
        assert up.returncode == 0, err[-3000:]
        assert "stopped while starting" in out and "router on" not in out
        assert all(_wait_gone(pid, 30) for pid in services)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


@pytest.mark.timeout(300)
def test_pdserve_up_serves_and_a_terminals_ctrl_c_drains_it_in_order():
    """``pdserve up`` serves until told to stop; Ctrl-C in its terminal reaches its whole
    process group, yet only the launcher takes it: requests in flight finish, each at its own
    stage (every prompt is prefilled on the prefill worker: one between its prefill and its
    decode leg still finds a decode worker), as the routers drain before any worker leaves,
    and everything exits."""
    from tests.serving_helpers import random_prompts

    up = subprocess.Popen([sys.executable, "-m", "engine.cli", "up", "--model", "tiny-llama",
                           "--max-local-prefill-length", "0"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True)  # its group: the terminal's stand-in
    outcomes: list = []
    try:
        line = next((ln for ln in up.stdout if "router on" in ln), "")
        assert line, up.stderr.read()[-3000:]
        address = line.split("router on ")[1].split()[0]
        services = _children(up.pid)
        threads, outcomes, first = _stream_in_background(
            address, random_prompts(8, seed=3, lo=200, hi=400))
        assert first.wait(120)
        _wait_all_taken(address, 8)
        os.killpg(up.pid, signal.SIGINT)  # Ctrl-C
        for t in threads:
            t.join(120)
        out, err = up.communicate(timeout=120)
        assert up.returncode == 0, err[-3000:]
        assert "pdserve up: stopping" in out
        assert outcomes == [(24, "length")] * 8
        assert len(services) >= 4 and all(_wait_gone(pid, 30) for pid in services)
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGKILL)
            up.wait()


def _wait_all_taken(address: str, n: int) -> None:
    """Until the router at ``address`` has taken ``n`` requests, each counted before its
    draining check: under load a background thread's call could reach the router after a
    stop began, and a request not yet in flight is answered UNAVAILABLE, as it should be."""
    from tests.serving_helpers import cluster_stats

    deadline = time.monotonic() + 120
    while cluster_stats(address).requests_total < n:
        assert time.monotonic() < deadline, "the requests never reached the router"
        time.sleep(0.05)


def _stream_in_background(address: str, prompts: list[list[int]]):
    """A thread streaming 24 greedy tokens for each prompt through the router at ``address``
    (no failover): (the threads, each one's outcome as it ends, an event set at the first
    token any of them gets). An outcome is (tokens, finish reason) or the exception."""
    import threading

    from client import Client, FailoverPolicy

    outcomes: list = []
    first = threading.Event()

    def stream(prompt):
        try:
            with Client(address, timeout=120, failover=FailoverPolicy(max_retries=0)) as c:
                chunks = []
                for chunk in c.generate(prompt, max_tokens=24, temperature=0.0,
                                        ignore_eos=True):
                    chunks.append(chunk)
                    first.set()
                outcomes.append((sum(len(ch.token_ids) for ch in chunks),
                                 chunks[-1].finish_reason))
        except Exception as e:  # noqa: BLE001 - the outcome is what the test checks
            outcomes.append(e)

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    return threads, outcomes, first


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except FileNotFoundError:
        return []


def test_pdserve_up_reports_a_failed_start_even_when_told_to_stop_meanwhile(monkeypatch,
                                                                          capsys):
    """A stop while the services started was an exception raised from the signal handler,
    wherever the main thread was: inside the start's own cleanup after a worker failed, it
    replaced that failure, and ``pdserve up`` exited 0."""
    from engine.cli import main
    from router import launcher

    def fails_while_stopped(self, should_abort=None):
        os.kill(os.getpid(), signal.SIGTERM)  # Ctrl-C as a worker fails to come up
        time.sleep(0.05)  # the handler runs here, on the main thread
        assert should_abort is not None and should_abort()
        raise RuntimeError("decode-1 exited with 1 while starting")

    monkeypatch.setattr(launcher.Cluster, "start", fails_while_stopped)
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        assert main(["up", "--model", "tiny-llama"]) == 1
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    assert "decode-1 exited with 1 while starting" in capsys.readouterr().err
