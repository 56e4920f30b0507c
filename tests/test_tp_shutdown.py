"""Shutting down a TP=2 engine whose worker never answers (stopped by SIGSTOP, as a wedged or
descheduled rank would be) ends in bounded time and leaves no worker process behind, even with
a step stuck in a collective on that worker."""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import datetime
import os
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import SHUTDOWN_TIMEOUT_S, AsyncEngine
from router.launcher import STOP_GRACE_S
from tests.proc_signals import alive, fd_targets, stop_process, tcp_rows, wait_until

# The launcher's grace (router.launcher) bounds the wait below: what a hang costs in a cluster
# is a kill without cleanup. It is far above shutdown's own budget, so this is no timing test:
# it only catches a shutdown that waits on the worker.
pytestmark = pytest.mark.timeout(90)
# A test with bounded waits of its own gets a pytest timeout above their sum, so that a hang
# fails on the test's own bound, with its message, and not on pytest's kill. A child Python
# that builds a TP=2 engine takes 5-10 s, and over 60 s on a host loaded to the extreme.
_CHILD_S = 150
_WITH_CHILD_S = _CHILD_S + 60  # and a margin for fixtures and what follows the child
_STEPPING_S = 30  # until a step is stuck on the stopped worker
# The graces a stopped worker makes shutdown wait out in full (5 s to quit, 3 s for a step),
# cut for the tests: what they check is that shutdown ends and kills it, not how long it
# waits first (test_a_services_stop_fits_in_the_launchers_grace checks the real budget).
_SHORT_GRACE_S = 0.5


def _short_graces(monkeypatch) -> None:
    from engine import async_engine, tp_executor

    monkeypatch.setattr(tp_executor, "_QUIT_GRACE_S", _SHORT_GRACE_S)
    monkeypatch.setattr(async_engine, "_STEP_GRACE_S", _SHORT_GRACE_S)


@contextlib.contextmanager
def _killed_after(proc, seconds: float = _CHILD_S):
    """Kills ``proc`` if it still runs after ``seconds``: its pipe then reads EOF, and the test
    fails on a hang instead of blocking in a read until pytest kills it. Yields an Event set
    when it killed."""
    fired = threading.Event()

    def kill():
        fired.set()
        proc.kill()

    timer = threading.Timer(seconds, kill)
    timer.daemon = True
    timer.start()
    try:
        yield fired
    finally:
        timer.cancel()


def _readline(proc, fired: threading.Event) -> str:
    line = proc.stdout.readline()
    assert not fired.is_set(), f"the child process hung: killed after {_CHILD_S} s"
    return line


def _children(pid: int) -> set[int]:
    """Live (not yet reaped) child processes of ``pid``."""
    kids: set[int] = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids.update(int(c) for c in f.read().split())
        except FileNotFoundError:  # the thread ended after listdir: it holds no child now
            pass
    return kids


def _stepping(engine: LLMEngine, request_id: str) -> bool:
    """The engine thread is in a step that holds ``request_id``."""
    if engine._lock.acquire(blocking=False):
        engine._lock.release()
        return False
    return request_id in engine.scheduler.requests


@pytest.mark.timeout(_STEPPING_S + STOP_GRACE_S + 60)
def test_shutdown_under_a_step_stuck_on_a_stopped_worker_is_bounded(preset_path, monkeypatch):
    _short_graces(monkeypatch)
    engine = LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                    num_gpu_blocks=32))
    worker = engine.executor.workers[0].process
    loop = asyncio.new_event_loop()  # outputs are posted to it; nobody needs to run it here
    async_engine = AsyncEngine(engine, loop=loop)
    try:
        stop_process(worker)
        engine.add_request("r", list(range(10, 60)), SamplingParams(max_tokens=4))
        async_engine._wake.set()
        # Rank 0 sent the step and waits in its collective for the stopped rank 1 (gloo
        # would wait minutes for a live peer).
        assert wait_until(lambda: _stepping(engine, "r"), _STEPPING_S)
        done = threading.Event()
        stopper = threading.Thread(target=lambda: (async_engine.shutdown(), done.set()),
                                   daemon=True)
        stopper.start()
        stopper.join(STOP_GRACE_S)  # past it, the launcher would kill rank 0 and orphan rank 1
        assert done.is_set(), "shutdown hung on the stopped worker"
        assert worker.returncode == -9  # killed after its quit grace, and reaped
        assert worker.pid not in _children(os.getpid())
        assert not async_engine.alive and async_engine.error is not None  # the step failed
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        engine.shutdown()
        loop.close()


def test_shutdown_of_an_idle_engine_with_a_stopped_worker_kills_it(preset_path, monkeypatch):
    _short_graces(monkeypatch)
    engine = LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                    num_gpu_blocks=32))
    worker = engine.executor.workers[0].process
    try:
        stop_process(worker)  # it never reads the quit
        engine.shutdown()
        assert worker.returncode == -9
        assert worker.pid not in _children(os.getpid())
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_a_worker_told_to_quit_exits_cleanly(preset_path):
    # The worker ends through engine.process_exit (its threads joined, exit handlers run, no
    # interpreter teardown): status 0 within the quit grace, where a hang there would be -9.
    with LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                num_gpu_blocks=32)) as engine:
        worker = engine.executor.workers[0].process
        engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=2))
        while engine.has_unfinished_requests():
            engine.step()
    assert worker.returncode == 0
    assert worker.pid not in _children(os.getpid())


def test_a_services_stop_fits_in_the_launchers_grace():
    """Drain, the gRPC stop grace and the engine's shutdown end before the launcher kills."""
    from engine import async_engine, tp_executor
    from engine.grpc_server import ServerConfig
    from engine.grpc_server import worst_case_stop_s
    from router.launcher import DRAIN_TIMEOUT_S, STOP_GRACE_S

    parts = (async_engine._STEP_GRACE_S + tp_executor._QUIT_GRACE_S
             + tp_executor._KILL_WAIT_S + async_engine._THREAD_EXIT_S)
    assert parts <= SHUTDOWN_TIMEOUT_S
    assert worst_case_stop_s(DRAIN_TIMEOUT_S, ServerConfig().grace_s) < STOP_GRACE_S


_PARENT = """
import sys, threading, time
from engine import EngineConfig, LLMEngine, SamplingParams

built = []
# Built on a thread that then ends, as a service builds its engine off the event loop: the
# kernel's death signal follows the thread that started a child, so that thread's end must
# not kill the rank, and the parent's must.
t = threading.Thread(target=lambda: built.append(LLMEngine(EngineConfig(
    sys.argv[1], tensor_parallel_size=2, num_gpu_blocks=32))))
t.start()
t.join()
engine = built[0]
time.sleep(0.5)  # a rank killed with the thread would be gone by now
engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=3, ignore_eos=True))
tokens = []
while engine.has_unfinished_requests():
    tokens += [t for out in engine.step() for t in out.new_token_ids]
print(len(tokens), engine.executor.workers[0].process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(_WITH_CHILD_S)
def test_a_stopped_rank_dies_with_its_sigkilled_parent(preset_path):
    import signal
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(preset_path("micro-llama"))],
                              stdout=subprocess.PIPE, text=True)
    try:
        with _killed_after(parent) as fired:
            num_tokens, rank = map(int, _readline(parent, fired).split())
        assert num_tokens == 3  # the rank outlived the thread that started it
        os.kill(rank, signal.SIGSTOP)  # it cannot even see its parent go
        parent.kill()
        parent.wait()
        assert wait_until(lambda: not alive(rank), 20), "the stopped rank outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()


_INTERRUPTED = """
import sys
from engine import EngineConfig, LLMEngine, SamplingParams
import engine.tp_executor as tp_executor
from engine.executor_error import ExecutorError

# Rank 1 waits in the interrupted step's collective and never reads the quit: shutdown kills
# it after this grace (5 s in the product; how long it waits is not the point here).
tp_executor._QUIT_GRACE_S = 0.5
engine = LLMEngine(EngineConfig(sys.argv[1], tensor_parallel_size=2, num_gpu_blocks=32))
worker = engine.executor.workers[0].process
runner = engine.executor.runner
run = runner.run

def interrupted(inp):
    runner.run = run
    raise KeyboardInterrupt

runner.run = interrupted
engine.add_request("r", list(range(10, 40)), SamplingParams(max_tokens=4))
try:
    engine.step()
except KeyboardInterrupt:
    print("interrupted", flush=True)
engine.abort("r")
engine.add_request("s", list(range(10, 40)), SamplingParams(max_tokens=4))
try:
    engine.step()
except ExecutorError as e:
    print(e, flush=True)
engine.shutdown()
print(worker.poll() is not None, flush=True)
"""


@pytest.mark.timeout(_WITH_CHILD_S)
def test_a_step_interrupted_on_rank_0_fails_the_engine_cleanly(preset_path):
    # A Ctrl-C (or a notebook's interrupt) inside rank 0's forward leaves the other ranks in
    # that step's collectives: the next step must not pair with them (gloo aborts the whole
    # process on the mismatch: hence a process of its own), but fail with a clear error.
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _INTERRUPTED,
                               str(preset_path("micro-llama"))],
                              capture_output=True, text=True, timeout=_CHILD_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"the child process hung: killed after {_CHILD_S} s; it printed "
                    f"{e.stdout or ''!r}, stderr ends {(e.stderr or '')[-2000:]!r}")
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0] == "interrupted" and lines[-1] == "True"  # the rank is gone after shutdown
    assert "a step was interrupted (KeyboardInterrupt); the ranks are out of step" in lines[1]


_DRAINING = """
import signal, sys
from engine import EngineConfig, LLMEngine, SamplingParams

engine = LLMEngine(EngineConfig(sys.argv[1], tensor_parallel_size=2, num_gpu_blocks=64))
signals = []
for sig in (signal.SIGINT, signal.SIGTERM):  # as a service does: drain on either
    signal.signal(sig, lambda s, f: signals.append(s))
engine.add_request("r", list(range(10, 30)), SamplingParams(max_tokens=120, ignore_eos=True))
tokens = 0
while engine.has_unfinished_requests():
    outs = engine.step()
    tokens += sum(len(o.new_token_ids) for o in outs)
    if tokens >= 5 and tokens - sum(len(o.new_token_ids) for o in outs) < 5:
        print("stepping", flush=True)
print(tokens, len(signals), flush=True)
engine.shutdown()
"""


@pytest.mark.timeout(_WITH_CHILD_S)
def test_a_signal_to_the_process_group_leaves_the_ranks_to_rank_0(preset_path):
    # A terminal's Ctrl-C or a service manager's stop signals every process of the group:
    # rank 0 drains on it, and its ranks must still be there to finish the step. Both
    # signals, one after the other, to one child (a child each took a TP=2 start-up each):
    # a rank that did not ignore either one dies of it (SIGINT's KeyboardInterrupt, SIGTERM's
    # default action) and the step fails.
    import signal
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", _DRAINING, str(preset_path("micro-llama"))],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        with _killed_after(child) as fired:  # its whole run: a kill ends the waits below
            assert _readline(child, fired).strip() == "stepping"
            os.killpg(child.pid, signal.SIGINT)
            os.killpg(child.pid, signal.SIGTERM)
            # Every token, and rank 0 saw both signals.
            assert _readline(child, fired).split() == ["120", "2"]
            assert child.wait(_CHILD_S) == 0
            assert not fired.is_set(), f"the child process hung: killed after {_CHILD_S} s"
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        child.stdout.close()


def test_a_rank_dead_at_the_last_step_of_start_up_is_named(preset_path, monkeypatch):
    # It answered every start-up message, then died before the group's first collective,
    # whose gloo error ("Connection reset by peer") said nothing of which rank or why. The
    # error is raised here in the collective's place: gloo connects lazily, and whether the
    # dead rank had published its address decides between that error and a wait for it.
    import signal
    from pathlib import Path

    import engine.tp_executor as tp_executor
    from engine.executor_error import ExecutorError

    connect, killed = tp_executor.tp_comm.connect_tp_group, []

    def kill_the_ranks(spec, runner):
        for pid in _children(os.getpid()):
            if b"engine.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
        return None

    def group_of_dead_peers(*args):
        group = connect(*args)
        all_reduce = group.all_reduce

        def after_the_deaths(*a, **kw):
            if killed:
                raise RuntimeError("[gloo pair.cc] Read error: Connection reset by peer")
            return all_reduce(*a, **kw)

        group.all_reduce = after_the_deaths
        return group

    monkeypatch.setattr(tp_executor, "make_rank_agent", kill_the_ranks)
    monkeypatch.setattr(tp_executor.tp_comm, "connect_tp_group", group_of_dead_peers)
    with pytest.raises(ExecutorError,
                       match=r"rank 1 \(pid \d+\) died \(killed by signal 9 \(SIGKILL\)\)"):
        LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                               num_gpu_blocks=32))
    assert killed


def _listening_sockets() -> set[str]:
    """The inodes of this process's TCP sockets in the LISTEN state."""
    inodes = {t[8:-1] for t in fd_targets().values() if t.startswith("socket:[")}
    return {r[9] for r in tcp_rows() if r[3] == "0A" and r[9] in inodes}


def test_a_shut_down_engine_still_referenced_holds_no_ports(preset_path):
    # Its TCP store and gloo group listened, and held a dozen fds, for as long as the engine
    # object lived (a fixture, a name after a `with` block).
    before = (_listening_sockets(), len(os.listdir("/proc/self/fd")))
    kept = []
    for _ in range(2):
        with LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                    num_gpu_blocks=32)) as engine:
            kept.append(engine)
    # None of its own left (an earlier test's may close meanwhile: not a count).
    assert _listening_sockets() <= before[0]
    assert len(os.listdir("/proc/self/fd")) - before[1] < 8  # 14 an engine before


def test_a_dead_ranks_exit_is_named_while_another_thread_reaps_it():
    """The monitor and the failing step both describe the rank that died. Popen.poll()
    answers None while another thread holds its reaping lock, and the executor's error then
    read "exit code None" instead of the signal that killed the rank."""
    import signal
    import subprocess
    import sys
    from multiprocessing.connection import Pipe

    from engine.tp_executor import _describe, _Worker

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours, theirs = Pipe()
    try:
        proc.kill()
        os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
        released = threading.Event()

        def hold_the_reaping_lock():
            with proc._waitpid_lock:
                released.wait(5)

        holder = threading.Thread(target=hold_the_reaping_lock)
        holder.start()
        threading.Timer(0.2, released.set).start()
        text = _describe(_Worker(1, proc, ours, sentinel=None))
        holder.join()
        assert f"killed by signal {int(signal.SIGKILL)}" in text
    finally:
        ours.close()
        theirs.close()
        proc.wait()


def test_every_thread_that_describes_a_dead_rank_gets_its_last_message():
    """The monitor and a failing step both describe the dead rank, and only the first read
    of its pipe finds its error: the other's text (the one that set the executor's error,
    if it won) said only "exit code 1"."""
    import subprocess
    import sys
    from multiprocessing.connection import Pipe

    from engine import tp_comm
    from engine.tp_executor import _describe, _Worker

    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    ours, theirs = Pipe()
    try:
        proc.wait()
        tp_comm.send(theirs, tp_comm.OP_ERROR, b"ValueError: the rank's own cause")
        worker = _Worker(1, proc, ours, sentinel=None)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            texts = list(pool.map(lambda _: _describe(worker), range(4)))
        assert len(set(texts)) == 1
        assert texts[0].endswith("died (exit status 1): ValueError: the rank's own cause")
    finally:
        ours.close()
        theirs.close()


def test_a_shutdown_right_after_a_steps_check_leaves_the_group_to_the_step(preset_path):
    """The step marked itself in flight only after checking the executor was usable: a
    shutdown from another thread in between released the process group (on a GPU, the device
    memory) under the step that was about to use them."""
    from engine.executor_error import ExecutorError

    engine = LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                    num_gpu_blocks=32))
    executor = engine.executor
    real_check, during = executor._check_usable, []

    def check_then_shut_down():
        real_check()
        stopper = threading.Thread(target=executor.shutdown)
        stopper.start()
        stopper.join(60)
        during.append(executor.group.backend)

    executor._check_usable = check_then_shut_down
    try:
        engine.add_request("r", list(range(10, 40)), SamplingParams(max_tokens=2))
        with pytest.raises(ExecutorError):
            engine.step()
        assert during and during[0] is not None
    finally:
        engine.shutdown()


def test_a_step_too_large_for_the_pipe_fails_on_a_stopped_worker_instead_of_hanging(
        preset_path, monkeypatch):
    """A step message larger than the worker's socket holds (~200 KB: 8k prompt tokens) blocked
    rank 0's send for good on a stopped worker; a small one fails at the collective timeout.
    The send gets as long."""
    from engine import tp_comm, tp_executor
    from engine.executor_error import ExecutorError

    # 16 x 1024 tokens: a ~400 KB step, twice what a unix socket holds by default (208 KiB).
    n, prompt_len = 16, 1024
    engine = LLMEngine(EngineConfig(str(preset_path("micro-llama")), tensor_parallel_size=2,
                                    num_gpu_blocks=n * (prompt_len // 16 + 2),
                                    max_num_batched_tokens=n * prompt_len))
    worker = engine.executor.workers[0].process
    try:
        # The group was built with the real timeout: only the send sees this one.
        monkeypatch.setattr(tp_comm, "COLLECTIVE_TIMEOUT", datetime.timedelta(seconds=2))
        # A failed step waits this long (5 s) for a worker's death to name it: this one is
        # stopped, not dead, and its error names it stopped or wedged without that wait.
        monkeypatch.setattr(tp_executor, "_DEATH_REPORT_S", 0.5)
        stop_process(worker)
        for i in range(n):
            engine.add_request(f"r{i}", [(7 * i + j) % 1000 + 10 for j in range(prompt_len)],
                               SamplingParams(max_tokens=2))
        with pytest.raises(ExecutorError, match="rank 1 .* is stopped or wedged"):
            engine.step()
        with pytest.raises(ExecutorError, match="stopped or wedged"):  # and stays failed
            engine.check_health()
    finally:
        worker.kill()
        worker.wait()
        engine.shutdown()


def test_a_step_sent_to_a_slow_reader_arrives_whole():
    """rank 0's step send (non-blocking, in parts) reads as one message on the worker."""
    import socket
    import time
    from multiprocessing.connection import Connection

    from engine import tp_comm

    ours, theirs = (Connection(s.detach()) for s in socket.socketpair())
    payload = os.urandom(3 << 20)
    got: list = []

    def read():
        time.sleep(0.2)  # the socket fills first
        got.extend(tp_comm.recv(theirs) for _ in range(2))

    reader = threading.Thread(target=read)
    reader.start()
    try:
        tp_comm.send_by(ours, tp_comm.OP_STEP, payload, time.monotonic() + 60)
        tp_comm.send_by(ours, tp_comm.OP_QUIT, b"", time.monotonic() + 60)
    finally:
        reader.join(60)
        ours.close()
        theirs.close()
    assert got == [(tp_comm.OP_STEP, payload), (tp_comm.OP_QUIT, b"")]
