"""Shutting down a TP=2 engine whose worker never answers (stopped by SIGSTOP, as a wedged or
descheduled rank would be) ends in bounded time and leaves no worker process behind, even with
a step stuck in a collective on that worker."""
from __future__ import annotations

import asyncio
import os
import threading

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.async_engine import SHUTDOWN_TIMEOUT_S, AsyncEngine
from router.launcher import STOP_GRACE_S
from tests.proc_signals import alive, stop_process, wait_until

# The launcher's grace (router.launcher) bounds the wait below: what a hang costs in a cluster
# is a kill without cleanup. It is far above shutdown's own budget, so this is no timing test:
# it only catches a shutdown that waits on the worker.
pytestmark = pytest.mark.timeout(90)


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


def test_shutdown_under_a_step_stuck_on_a_stopped_worker_is_bounded(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), tensor_parallel_size=2,
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
        assert wait_until(lambda: _stepping(engine, "r"))
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


def test_shutdown_of_an_idle_engine_with_a_stopped_worker_kills_it(preset_path):
    engine = LLMEngine(EngineConfig(str(preset_path("tiny-llama")), tensor_parallel_size=2,
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
    with LLMEngine(EngineConfig(str(preset_path("tiny-llama")), tensor_parallel_size=2,
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


def test_a_stopped_rank_dies_with_its_sigkilled_parent(preset_path):
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(preset_path("tiny-llama"))],
                              stdout=subprocess.PIPE, text=True)
    try:
        num_tokens, rank = map(int, parent.stdout.readline().split())
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
