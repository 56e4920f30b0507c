"""Idle liveness pings of TP workers (engine/tp_liveness.py): a rank that stops answering while
no step runs fails the engine within the ping bound, not at the next request's step timeout,
and the pings never disturb the steps they share the control pipe with. Real ranks (worker
processes over gloo), a real worker process for the serving path."""
from __future__ import annotations

import asyncio
import dataclasses
import fcntl
import os
import random
import signal
import struct
import subprocess
import sys
import termios
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_front import EngineDeadError, EngineStepTimeout
from engine.config import EngineConfig
from engine.executor_error import ExecutorError
from engine.llm_engine import LLMEngine
from router.proc_family import descendants
from tests.proc_signals import reap, stop_process, wait_until

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(300)
# Hang guards, far above what each wait takes (a ping bound of 1 s): no timing asserts.
_DEATH_WAIT_S = 60.0
_GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _short_graces(monkeypatch) -> None:
    """Shutdown waits out a grace on a stopped rank (5 s for its quit; 3 s for an engine thread
    stuck on it) before it kills it: half a second here, where the point is what failed
    the engine, not how long its shutdown waits."""
    from engine import async_engine, tp_executor

    monkeypatch.setattr(tp_executor, "_QUIT_GRACE_S", 0.5)
    monkeypatch.setattr(async_engine, "_STEP_GRACE_S", 0.5)


def _tp2(path: str, interval_s: float, timeout_s: float = 10.0) -> LLMEngine:
    return LLMEngine(EngineConfig(path, tensor_parallel_size=2, num_gpu_blocks=64,
                                  tp_idle_ping_interval_s=interval_s,
                                  tp_idle_ping_timeout_s=timeout_s))


def _unread(conn) -> int:
    """Bytes sent down ``conn`` that its peer has not read yet (SIOCOUTQ, a unix socket's)."""
    return struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


@dataclasses.dataclass
class _Deaths:
    """What an AsyncEngine's on_dead was told, and an event set by it."""
    event: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    causes: list = dataclasses.field(default_factory=list)

    def __call__(self, error: BaseException) -> None:
        self.causes.append(error)
        self.event.set()


def _watched(engine, step_timeout_s: float):
    """``engine`` stepped by an AsyncEngine (on the running loop) whose death is recorded."""
    deaths = _Deaths()
    return AsyncEngine(engine, on_dead=deaths, step_timeout_s=step_timeout_s), deaths


def test_a_rank_stopped_while_idle_fails_the_engine_before_any_step(preset_path, monkeypatch):
    """Without the pings nothing asks an idle rank anything: the engine stayed up, the
    worker SERVING, until a request's step waited out the step timeout (120 s) on it."""
    _short_graces(monkeypatch)
    engine = _tp2(str(preset_path("micro-llama")), interval_s=0.1, timeout_s=1.0)
    (rank1,) = engine.executor.workers

    async def run():
        # A step timeout far beyond the wait below: only the pings can find the stop.
        ae, deaths = _watched(engine, step_timeout_s=3600)
        try:
            outs = [o async for o in ae.generate("warm", [5, 6, 7, 8], _GREEDY)]
            assert outs[-1].finish_reason == "length"  # it served before the stop
            stop_process(rank1.process)
            await asyncio.wait_for(deaths.event.wait(), _DEATH_WAIT_S)
            assert not ae.alive
            return deaths.causes
        finally:
            ae.shutdown()  # kills the stopped rank

    (cause,) = asyncio.run(run())
    assert isinstance(cause, ExecutorError)
    assert f"rank 1 (pid {rank1.process.pid}) did not answer an idle ping" in str(cause)
    assert rank1.process.poll() is not None  # the shutdown ended it


def test_a_ping_waiting_on_a_stopped_rank_is_bounded_by_the_step_timeout(preset_path,
                                                                          monkeypatch):
    """The engine thread waits out a ping on the rank it pings, and a request that comes
    meanwhile waits with it: a ping timeout above the step timeout kept the engine up, its
    requests waiting, for the whole ping timeout (30 s against a step timeout of 3 s, measured),
    where without pings the request's step died at the step timeout. The watchdog bounds the
    check as it bounds a step."""
    _short_graces(monkeypatch)
    engine = _tp2(str(preset_path("micro-llama")), interval_s=0.1, timeout_s=3600.0)
    (rank1,) = engine.executor.workers

    async def run():
        ae, deaths = _watched(engine, step_timeout_s=2)
        try:
            stop_process(rank1.process)
            # A ping sent and unread (no step ran): the engine thread waits on its answer.
            assert await asyncio.to_thread(wait_until, lambda: _unread(rank1.conn) > 0,
                                           _DEATH_WAIT_S)
            waiting = asyncio.ensure_future(_drain(ae.generate("after", [5, 6, 7], _GREEDY)))
            await asyncio.wait_for(deaths.event.wait(), _DEATH_WAIT_S)
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(waiting, _DEATH_WAIT_S)
            return deaths.causes
        finally:
            ae.shutdown()  # kills the stopped rank

    (cause,) = asyncio.run(run())
    assert isinstance(cause, EngineStepTimeout)
    assert "an idle health check of the engine has run" in str(cause)
    assert rank1.process.poll() is not None


async def _drain(stream) -> list:
    return [o async for o in stream]


def test_pings_at_a_tiny_interval_leave_concurrent_requests_untouched(preset_path):
    """Requests arriving while the engine thread pings between steps, and another thread
    pinging all along (check_health from anywhere must not interleave with a step's send):
    the greedy tokens are TP=1's, and the pings did run. On tiny-llama: these prompts are not
    drawn for decisive steps, and micro-llama's steps are decided by less."""
    path = str(preset_path("tiny-llama"))
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 8000) for _ in range(rng.randrange(3, 90))] for _ in range(12)]
    want = [o.token_ids for o in LLM(path, num_gpu_blocks=64).generate(prompts, _GREEDY)]
    engine = _tp2(path, interval_s=0.001)
    stop = threading.Event()
    pinger_errors = []

    def pinger():
        try:
            while not stop.is_set():
                engine.check_health()  # skipped while a step holds the pipes
        except BaseException as e:  # the test fails on it below
            pinger_errors.append(e)

    async def one(ae, i: int, prompt: list[int]) -> list[int]:
        # Spread out, so the engine goes idle (and pings) between some of them.
        await asyncio.sleep(rng.random() * 0.5)
        outs = [o async for o in ae.generate(f"r{i}", prompt, _GREEDY)]
        return [t for o in outs for t in o.new_token_ids]

    async def run():
        ae = AsyncEngine(engine)
        thread = threading.Thread(target=pinger)
        thread.start()
        try:
            got = await asyncio.gather(*(one(ae, i, p) for i, p in enumerate(prompts)))
            assert ae.alive
            return got
        finally:
            stop.set()
            thread.join()
            ae.shutdown()

    # The pinger's loop never lets go of the GIL on its own: the engine thread, back from each
    # torch op that released it, waited out the whole switch interval (5 ms) for it, and a
    # step took ~0.5 s. A short interval lets the steps run at their pace, and switches
    # between the two threads more often (~50x as many a second), not less.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        got = asyncio.run(run())
    finally:
        sys.setswitchinterval(interval)
    assert pinger_errors == []
    assert got == want
    assert engine.executor.idle_pings > 0


def test_a_rank_slow_in_a_step_is_not_pinged(preset_path):
    """A rank held up inside a step (here stopped, then let go, as a slow or descheduled
    rank would be) answers nothing until the step ends: a check meanwhile must not ping it
    and take it for wedged. It is skipped; once the step is through, pings run again."""
    path = str(preset_path("tiny-llama"))
    prompt = list(range(20, 60))
    (want,) = LLM(path, num_gpu_blocks=64).generate([prompt], _GREEDY)
    engine = _tp2(path, interval_s=0.001, timeout_s=0.5)
    (rank1,) = engine.executor.workers
    engine.add_request("slow", prompt, _GREEDY)
    stop_process(rank1.process)
    outs = []
    stepping = threading.Thread(target=lambda: outs.extend(engine.step()))
    stepping.start()  # rank 0 sends the step and waits in its first collective on rank 1
    try:
        # Sent (and unread: rank 1 is stopped), so rank 0 is past the send, in its forward.
        assert wait_until(lambda: engine.executor._step_in_flight and _unread(rank1.conn),
                          _DEATH_WAIT_S)
        engine.check_health()  # not a ping: the step holds the pipes
        assert engine.executor.idle_pings == 0
    finally:
        os.kill(rank1.process.pid, signal.SIGCONT)
        stepping.join()
    try:
        while not any(o.finished for o in outs):
            outs += engine.step()
        # Idle again: the next check due (1 ms after the last step) pings, and rank 1 answers.
        assert wait_until(lambda: engine.check_health() or engine.executor.idle_pings,
                          _DEATH_WAIT_S)
    finally:
        engine.shutdown()
    assert [t for o in outs for t in o.new_token_ids] == want.token_ids


def test_a_prefill_worker_with_a_rank_stopped_while_idle_goes_not_serving_and_exits(
        preset_path):
    """The serving path: `pdserve prefill -tp 2`, idle, rank 1 SIGSTOPped. The worker's health
    turns NOT_SERVING and it exits 1 for its supervisor, as on a dead rank or a step timeout."""
    # Its shutdown kills the stopped rank after half a second, not 5 (tests/engine_faults).
    env = dict(os.environ, PDSERVE_TEST_FAULT="quit_grace:0.5", PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO / "tests" / "engine_faults"), os.environ.get("PYTHONPATH")) if p))
    read_fd, write_fd = os.pipe()
    worker = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "prefill", "--model",
         str(preset_path("micro-llama")), "-tp", "2", "--port", "0", "--num-gpu-blocks", "32",
         "--tp-idle-ping-interval-s", "0.2", "--tp-idle-ping-timeout-s", "1",
         "--ready-fd", str(write_fd)],
        cwd=REPO, env=env, pass_fds=(write_fd,), stderr=subprocess.PIPE, text=True)
    os.close(write_fd)
    ranks = []
    try:
        with os.fdopen(read_fd) as ready:
            address = ready.readline().strip()  # EOF ("") if it died starting
        assert address, worker.communicate(timeout=_DEATH_WAIT_S)[1][-3000:]
        ranks = [pid for pid in descendants(worker.pid)
                 if b"engine.tp_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(ranks) == 1
        with grpc.insecure_channel(address) as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(health_pb2.HealthCheckRequest(),
                                                         timeout=_DEATH_WAIT_S)
            first = next(watch).status
            assert first == health_pb2.HealthCheckResponse.SERVING
            os.kill(ranks[0], signal.SIGSTOP)
            then = next(watch).status
        assert then == health_pb2.HealthCheckResponse.NOT_SERVING
        _, err = worker.communicate(timeout=_DEATH_WAIT_S)
    finally:
        for pid in ranks:  # the worker's shutdown kills it; not if the test failed first
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        reap(worker)
    assert worker.returncode == 1, err[-3000:]
    assert "did not answer an idle ping" in err


def test_the_ping_flags_reach_the_engine_config():
    from engine.cli import build_parser
    from engine.cli_serve import _worker_config

    def cfg(*extra):
        args = build_parser().parse_args(["prefill", "--model", "tiny-llama", *extra])
        return _worker_config(args, "prefill").engine

    assert (cfg().tp_idle_ping_interval_s, cfg().tp_idle_ping_timeout_s) == (5.0, 10.0)
    got = cfg("--tp-idle-ping-interval-s", "0", "--tp-idle-ping-timeout-s", "3")
    assert (got.tp_idle_ping_interval_s, got.tp_idle_ping_timeout_s) == (0.0, 3.0)
    with pytest.raises(ValueError, match="tp_idle_ping_interval_s"):
        cfg("--tp-idle-ping-interval-s", "-1")
