"""`--engine-process` when things go wrong: a wedged or stopped engine process, messages that
cannot cross, races between the two processes, and what must cross only once. Real child
processes; faults inside them come from tests/engine_faults (applied as the child starts)."""
from __future__ import annotations

import asyncio
import re
import gc
import os
import pickle
import select
import signal
import socket
import threading
from pathlib import Path

import pytest

from engine import SamplingParams
from engine.config import EngineConfig
from engine.core_share import CoreShareConfig
from engine.engine_client import EngineProcess, _wait_ready
from engine.engine_front import EngineDeadError, EngineStepTimeout
from engine.engine_pipe import (BadFrame, EngineProcSpec, FrameReader, FrameWriter,
                                QueuedSender)
from tests.proc_signals import stop_process

MODEL = "micro-llama"
_FAULTS_DIR = str(Path(__file__).resolve().parent / "engine_faults")


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _config(**config) -> EngineConfig:
    return EngineConfig(MODEL, num_gpu_blocks=64, **config)


async def _start(step_timeout_s: float | None = None, core_share=None,
                 **config) -> EngineProcess:
    return await EngineProcess.start(EngineProcSpec(_config(**config), core_share,
                                                    step_timeout_s))


@pytest.fixture
def fault(monkeypatch):
    """``fault("name:args")``: the engine processes this test starts next run with that fault
    (tests/engine_faults/sitecustomize.py)."""
    def use(spec: str) -> None:
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
            p for p in (_FAULTS_DIR, os.environ.get("PYTHONPATH")) if p))
        monkeypatch.setenv("PDSERVE_TEST_FAULT", spec)

    return use


# --- a wedged engine process ------------------------------------------------------------------
@pytest.fixture
def short_silence_grace(monkeypatch):
    """The worker takes a silent engine process for wedged this long past its step timeout:
    2 s here instead of 5. The process ticks every second (engine_pipe.TICK_S) while it
    runs, so a live one is never silent that long; what the tests check is that a silent one
    is killed, not when."""
    from engine import engine_client

    monkeypatch.setattr(engine_client, "_SILENCE_GRACE_S", 2.0)


class _LoopWatch:
    """From a thread: whether the loop runs callbacks. One that has not for ``stuck_s`` is
    blocked for good (a send on a full pipe): the watch kills ``pid`` to free it, so the test
    fails instead of hanging, and says so."""

    def __init__(self, loop: asyncio.AbstractEventLoop, pid: int, stuck_s: float = 30) -> None:
        self.loop, self.pid, self.stuck_s = loop, pid, stuck_s
        self.stuck = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            ran = threading.Event()
            self.loop.call_soon_threadsafe(ran.set)
            if not ran.wait(self.stuck_s):
                self.stuck = True
                os.kill(self.pid, signal.SIGKILL)
                return
            self._stop.wait(0.1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_a_stopped_engine_process_is_taken_for_wedged_and_never_blocks_the_loop(
        short_silence_grace):
    """SIGSTOPped, the process reads nothing and its own step watchdog cannot run. The worker
    goes on serving its loop while hundreds of requests are sent to it (more than the pipe
    holds), and once the process has been silent past the step timeout it is killed: every
    stream and call fails, on_dead hears why."""
    async def run():
        deaths: list[BaseException] = []
        proc = await _start(step_timeout_s=1)
        proc.on_dead = deaths.append
        watch = _LoopWatch(asyncio.get_running_loop(), proc.info.pid)
        try:
            stream = proc.generate("r", [5, 6, 7, 8], _greedy(900))
            await anext(stream)
            stop_process(proc.proc)
            prompt = [(j * 7919) % 8000 + 5 for j in range(1000)]
            many = [asyncio.ensure_future(anext(proc.generate(f"q{i}", prompt, _greedy(2))))
                    for i in range(400)]
            await asyncio.sleep(0)  # every one of them has sent its add_request now
            with pytest.raises(EngineDeadError, match="wedged"):
                async for _ in stream:
                    pass
            failed = await asyncio.gather(*many, return_exceptions=True)
            with pytest.raises(EngineDeadError):
                await asyncio.to_thread(proc.llm.cached_block_hashes)
            return deaths, failed, proc.alive
        finally:
            watch.stop()
            proc.shutdown()
            assert not watch.stuck, "the worker's loop blocked sending to the stopped process"

    deaths, failed, alive = asyncio.run(run())
    assert len(deaths) == 1 and isinstance(deaths[0], EngineStepTimeout) and not alive
    assert all(isinstance(e, EngineDeadError) for e in failed)


def test_an_engine_process_whose_gil_a_c_call_holds_is_killed_as_wedged(fault,
                                                                        short_silence_grace):
    """A hung C call holding the GIL stops the process's own step watchdog too: only the
    worker can tell, by its silence."""
    fault("hold_gil_at_step:3,120")

    async def run():
        deaths: list[BaseException] = []
        proc = await _start(step_timeout_s=1)
        proc.on_dead = deaths.append
        try:
            with pytest.raises(EngineDeadError, match="has sent nothing for .* wedged"):
                async for _ in proc.generate("r", [5, 6, 7], _greedy(900)):
                    pass
            with pytest.raises(EngineDeadError):  # no new request is taken
                async for _ in proc.generate("later", [5, 6], _greedy(2)):
                    pass
        finally:
            proc.shutdown()
        return deaths, proc.proc.returncode

    deaths, code = asyncio.run(run())
    assert len(deaths) == 1 and isinstance(deaths[0], EngineStepTimeout)
    assert code == -signal.SIGKILL


def test_a_reply_that_cannot_be_pickled_fails_its_call_and_later_calls_still_answer(fault):
    fault("unpicklable_kv_peer_names")

    async def run():
        proc = await _start()
        try:
            with pytest.raises(RuntimeError, match="cannot cross"):
                await asyncio.wait_for(asyncio.to_thread(proc.llm.kv_peer_names), 60)
            hashes = await asyncio.wait_for(asyncio.to_thread(proc.llm.cached_block_hashes), 60)
            # Arguments that cannot be pickled raise in the caller, and nothing is left waiting.
            with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
                proc.submit("pull_kv", lambda: None)
            return hashes, proc._calls
        finally:
            proc.shutdown()

    hashes, calls = asyncio.run(run())
    assert isinstance(hashes, list) and calls == {}


def test_a_message_the_worker_cannot_read_takes_the_engine_process_for_dead(fault):
    fault("unloadable_kv_peer_names")

    async def run():
        deaths: list[BaseException] = []
        proc = await _start()
        proc.on_dead = deaths.append
        try:
            stream = proc.generate("r", [5, 6, 7], _greedy(900))
            await anext(stream)
            with pytest.raises(EngineDeadError, match="cannot be read"):
                await asyncio.wait_for(asyncio.to_thread(proc.llm.kv_peer_names), 60)
            with pytest.raises(EngineDeadError, match="cannot be read"):
                async for _ in stream:
                    pass
            return deaths, proc.alive
        finally:
            proc.shutdown()

    deaths, alive = asyncio.run(run())
    assert len(deaths) == 1 and "cannot be read" in str(deaths[0]) and not alive


def test_queued_sends_never_wait_for_the_reader_and_keep_their_order():
    ours, theirs = socket.socketpair()
    sender = QueuedSender(FrameWriter(ours), "test-sender")
    try:
        sent = [("step", i, b"x" * (1 << 20)) for i in range(16)]  # more than a socket holds
        for msg in sent:
            sender.send(msg)  # returns though nothing reads yet
        with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
            sender.send(("call", lambda: None))
        theirs.setblocking(False)
        reader, got = FrameReader(theirs), []
        while len(got) < len(sent):
            select.select([theirs], [], [], 5)
            got += reader.read_ready()
        assert got == sent
    finally:
        theirs.close()
        sender.send(("after the reader left",))
        sender.close(timeout_s=10)  # its send fails: the thread ends
        ours.close()
    assert not sender._thread.is_alive()


# --- races -------------------------------------------------------------------------------------
def test_an_engine_thread_that_steps_before_ready_is_sent_does_not_fail_the_start(fault):
    """Building the engine's info takes 1 s (a descheduled main thread): an engine thread
    already running would have sent its first idle step by then."""
    fault("slow_kv_cache_layouts:1.0")

    async def run():
        proc = await _start()
        try:
            return [t async for o in proc.generate("r", [5, 6, 7], _greedy(3))
                    for t in o.new_token_ids]
        finally:
            proc.shutdown()

    assert len(asyncio.run(run())) == 3


def test_waiting_for_ready_skips_what_comes_before_it_and_raises_what_cannot_be_read():
    from engine.engine_pipe import EngineProcInfo

    ours, theirs = socket.socketpair()
    info = EngineProcInfo(1, 64, [], [], None)
    writer, reader = FrameWriter(theirs), FrameReader(ours)
    for msg in [("tick",), ("step", [], None, []), ("ready", info), ("ready", _Unloadable())]:
        writer.send(msg)
    try:
        got = _wait_ready(reader, proc=None)
        with pytest.raises(BadFrame):  # not taken for the end of a process that still runs
            _wait_ready(reader, proc=None)
    finally:
        ours.close()
        theirs.close()
    assert got == info


@pytest.mark.parametrize("ended", [False, True])
def test_what_came_with_ready_is_read_as_the_engine_process_starts(ended):
    """The engine thread failed to start after "ready" was sent: ("dead", why) came in the
    same read as "ready". Read at once, and before the pipe's end, it names the cause; the
    process then ended (exit code 0, which says nothing), or it is still closing up."""
    import subprocess
    import sys

    from engine.engine_pipe import EngineProcInfo

    ours, theirs = socket.socketpair()
    down_ours, down_theirs = socket.socketpair()
    writer = FrameWriter(theirs)
    writer.send(("ready", EngineProcInfo(1, 64, [], [], None)))
    writer.send(("dead", ValueError("the engine thread could not start")))
    if ended:
        theirs.close()
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()

    async def run():
        reader = FrameReader(ours)
        info = await asyncio.to_thread(_wait_ready, reader, proc)
        deaths: list[BaseException] = []
        engine = EngineProcess(proc, reader, FrameWriter(down_ours), info,
                               asyncio.get_running_loop(), on_dead=deaths.append)
        try:
            for _ in range(100):
                if deaths:
                    break
                await asyncio.sleep(0.05)
        finally:
            engine.shutdown()
        return deaths

    try:
        deaths = asyncio.run(run())
    finally:
        theirs.close()
        down_theirs.close()
    assert [repr(e) for e in deaths] == [repr(ValueError("the engine thread could not start"))]


def test_a_late_add_reply_of_a_cancelled_request_does_not_abort_a_new_one_with_its_id():
    """A caller leaves while its one-token request is being added; the request's last output
    overtakes the add's reply (they come from different threads of the engine process), the id
    is free again and a new request takes it. The reply (held back here) must not abort it."""
    async def run():
        proc = await _start()
        held, handle, first_call = [], proc._handle, [None]

        def hold_back(msg: tuple) -> None:  # the first caller's add reply comes late
            if msg[0] == "reply" and msg[1] == first_call[0]:
                held.append(msg)
            else:
                handle(msg)

        proc._handle = hold_back
        try:
            first = asyncio.ensure_future(anext(proc.generate("same", [5, 6, 7], _greedy(1))))
            await asyncio.sleep(0)  # its add_request is sent
            first_call[0] = max(proc._calls)
            first.cancel()
            while "same" in proc._held:  # its last output came: the id is free
                await asyncio.sleep(0.01)
            second = proc.generate("same", [9, 10, 11], _greedy(40))
            outs = [await anext(second)]
            while not held:
                await asyncio.sleep(0.01)
            handle(held.pop())  # now the reply
            outs += [o async for o in second]
            # A cancelled add that failed leaves no output to free its id: its reply does.
            bad = asyncio.ensure_future(anext(proc.generate("bad", [5, 10**9], _greedy(2))))
            await asyncio.sleep(0)
            bad.cancel()
            while "bad" in proc._held:
                await asyncio.sleep(0.01)
            after = [o async for o in proc.generate("bad", [5, 6], _greedy(2))]
            return outs, after
        finally:
            proc.shutdown()

    outs, after = asyncio.run(run())
    assert sum(len(o.new_token_ids) for o in outs) == 40
    assert outs[-1].finish_reason == "length"
    assert after[-1].finish_reason == "length"


# --- what crosses --------------------------------------------------------------------------------
def _in_process_outputs(prompt, params: SamplingParams) -> list:
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    async def run():
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, _config()))
        try:
            return [o async for o in engine.generate("r", prompt, params)]
        finally:
            engine.shutdown()

    return asyncio.run(run())


def _comparable(plp) -> list | None:
    """Prompt logprobs with the values rounded: two processes may sum in another order."""
    if plp is None:
        return None
    return [None if t is None else (t.sampled.token_id, t.sampled.rank,
                                    [(x.token_id, x.rank) for x in t.top],
                                    pytest.approx(t.sampled.logprob, abs=1e-3))
            for t in plp]


def test_prompt_logprobs_cross_once_and_every_output_still_carries_them():
    """Complete once scored, a request's prompt logprobs go with each of its outputs: sent
    each time, a long prompt's made every step message ~1 MB and the whole batch slow."""
    prompt = [(7 * j) % 7000 + 5 for j in range(150)]
    params = _greedy(12, prompt_logprobs=3)

    async def run():
        proc = await _start()
        carried, handle = [], proc._handle

        def count(msg: tuple) -> None:
            if msg[0] == "step":
                carried.extend(isinstance(t[8], list) for t in msg[1] if t[0] == "r")
            handle(msg)

        proc._handle = count
        try:
            outs = [o async for o in proc.generate("r", prompt, params)]
            again = [o async for o in proc.generate("r", prompt, params)]  # the id, reused
            return outs, again, carried, proc._decoder._got
        finally:
            proc.shutdown()

    outs, again, carried, remembered = asyncio.run(run())
    want = _in_process_outputs(prompt, params)
    assert len(outs) > 3 and sum(carried) == 2  # once per request
    for got in (outs, again):
        assert [o.new_token_ids for o in got] == [o.new_token_ids for o in want]
        assert ([_comparable(o.prompt_logprobs) for o in got]
                == [_comparable(o.prompt_logprobs) for o in want])
    assert want[-1].prompt_logprobs is not None and remembered == {}


@pytest.mark.parametrize("params", [
    _greedy(4),
    # A guide crosses as its text and is compiled where the engine runs.
    SamplingParams(max_tokens=16, temperature=0.0, guided_regex=r"\d{2}-[a-z]{2,4}")],
    ids=["plain", "guided"])
def test_a_text_prompt_crosses_as_text(params):
    async def run():
        proc = await _start()
        try:
            return [o async for o in proc.generate("r", "hello world", params)]
        finally:
            proc.shutdown()

    got = asyncio.run(run())
    want = _in_process_outputs("hello world", params)
    assert [t for o in got for t in o.new_token_ids] == [t for o in want
                                                         for t in o.new_token_ids]
    if params.guided_regex:
        assert re.fullmatch(params.guided_regex, got[-1].text) and got[-1].finished


def test_a_guide_being_built_holds_up_no_other_request_and_loses_no_abort(fault, tmp_path):
    """Two guided requests arrive whose guides take long to build (held here until a file
    exists): a plain request is added and runs to its end meanwhile, and the second guided
    one, aborted while its guide builds, ends "abort" once it is added. Built on the engine
    process's loop, the guide held every other add behind it."""
    go = tmp_path / "go"
    fault(f"guides_wait_for:{go}")
    guided = SamplingParams(max_tokens=16, temperature=0.0, guided_regex=r"\d{2}-[a-z]{2,4}")
    long_guided = SamplingParams(max_tokens=200, temperature=0.0,
                                 guided_regex=r"[a-z ]{1,1000}")

    async def run():
        proc = await _start()
        try:
            first = proc.generate("g", "hello world", guided)
            first_out = asyncio.ensure_future(anext(first))
            aborted = proc.generate("c", "hello", long_guided)
            aborted_out = asyncio.ensure_future(anext(aborted))
            while not (tmp_path / "go.building").exists():  # a build has begun
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # both adds are in the engine process
            proc.abort("c")
            plain = await asyncio.wait_for(_collect_all(proc.generate("p", [5, 6, 7],
                                                                      _greedy(6))), 60)
            assert not first_out.done() and not aborted_out.done()
            assert (tmp_path / "go.building").read_text().startswith("pdserve-guide")
            go.touch()
            got = [await asyncio.wait_for(first_out, 60)] + [o async for o in first]
            ended = [await asyncio.wait_for(aborted_out, 60)] + [o async for o in aborted]
            return plain, got, ended
        finally:
            go.touch()
            proc.shutdown()

    plain, got, ended = asyncio.run(run())
    assert sum(len(o.new_token_ids) for o in plain) == 6
    assert re.fullmatch(guided.guided_regex, got[-1].text) and got[-1].finish_reason == "stop"
    assert ended[-1].finish_reason == "abort"


async def _collect_all(stream) -> list:
    return [o async for o in stream]


def test_an_engine_failing_after_it_is_built_fails_the_start_with_its_error():
    """A core share that cannot be opened, found once the engine is built: the worker hears
    why, not only that the process exited."""
    share = CoreShareConfig("/nonexistent-dir/core-share", num_cores=2, base_threads=1)
    with pytest.raises(ValueError, match="cannot open the core share file"):
        asyncio.run(_start(core_share=share))


class _Unloadable:  # pickles, fails when unpickled
    def __reduce__(self):
        return (int, ("not a number",))


def test_a_message_that_cannot_be_unpickled_raises_once_and_hides_nothing_else():
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    reader, writer = FrameReader(ours), FrameWriter(theirs)
    try:
        for msg in [("reply", 1, True, "first"), ("reply", 2, True, _Unloadable()),
                    ("reply", 3, True, "third")]:
            writer.send(msg)
        select.select([ours], [], [], 5)
        first = reader.read_ready()
        with pytest.raises(BadFrame, match="ValueError"):
            reader.read_ready()
        rest = reader.read_ready()
    finally:
        ours.close()
        theirs.close()
    assert first == [("reply", 1, True, "first")] and rest == [("reply", 3, True, "third")]


# --- a dead engine's leases, as a drain counts them ----------------------------------------------
def _drain_count(engine) -> int:
    """What a prefill worker's drain waits for, with no call in flight."""
    from types import SimpleNamespace

    from engine.worker_server import _num_in_flight

    return _num_in_flight(SimpleNamespace(config=SimpleNamespace(role="prefill"),
                                          engine=engine, inflight=0))


def test_a_dead_engines_leases_are_counted_as_they_end_not_as_its_last_step_saw_them():
    """A prefill worker's drain waits for its leases. Once its engine died no step refreshed
    the stats it read, so a lease released after the death (ReleaseKV, a decode worker's
    release) still counted, and the dying worker sat out its whole --drain-timeout-s."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    async def run():
        engine = AsyncEngine(await asyncio.to_thread(LLMEngine, _config(role="prefill")))
        try:
            [_ async for _ in engine.generate("r", list(range(10, 50)), _greedy(8))]
            assert engine.num_leased == 1
            died = asyncio.get_running_loop().create_future()
            engine.on_dead = died.set_result

            def broken_step():
                raise RuntimeError("a device error")

            engine.engine.step = broken_step  # the next idle tick's step dies
            await asyncio.wait_for(died, 30)
            assert not engine.alive and engine.stats.num_leased == 1  # the last step's
            engine.release_kv("r")
            return _drain_count(engine)
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == 0


def test_a_dead_engines_leases_still_expire_for_the_drain():
    """Leases expire in the engine's steps: once it died, a lease nobody released (its
    router died too) counted until the worker's whole --drain-timeout-s ran out."""
    from engine.async_engine import AsyncEngine
    from engine.llm_engine import LLMEngine

    async def run():
        engine = AsyncEngine(await asyncio.to_thread(
            LLMEngine, _config(role="prefill", kv_lease_timeout_s=0.3)))
        try:
            [_ async for _ in engine.generate("r", list(range(10, 50)), _greedy(8))]
            died = asyncio.get_running_loop().create_future()
            engine.on_dead = died.set_result

            def broken_step():
                raise RuntimeError("a device error")

            engine.engine.step = broken_step
            await asyncio.wait_for(died, 30)
            await asyncio.sleep(0.5)  # past the lease's end
            return _drain_count(engine), engine.alive, engine.engine.num_expired_leases
        finally:
            engine.shutdown()

    assert asyncio.run(run()) == (0, False, 1)  # expired, not released


def test_a_dead_engine_process_holds_no_leases_to_wait_for():
    """Its KV went with it: no release reaches it and no reader gets the blocks."""
    async def run():
        proc = await _start(role="prefill")
        try:
            died = asyncio.get_running_loop().create_future()
            proc.on_dead = died.set_result
            [_ async for _ in proc.generate("r", list(range(10, 50)), _greedy(8))]
            await proc.fresh_stats()
            assert proc.num_leased == 1
            os.kill(proc.proc.pid, signal.SIGKILL)
            await asyncio.wait_for(died, 30)
            return proc.stats.num_leased, _drain_count(proc)
        finally:
            proc.shutdown()

    assert asyncio.run(run()) == (1, 0)


def test_a_stats_take_left_behind_by_a_stuck_step_fails_quietly_when_the_engine_dies():
    """fresh_stats answers with the last stats once its take waits too long (a step holds the
    engine, or the process is stopped); the take still fails when the engine dies, and nobody
    awaits it: asyncio must not report it as an exception never retrieved."""
    async def run():
        loop = asyncio.get_running_loop()
        reported: list[str] = []
        loop.set_exception_handler(lambda _, context: reported.append(context["message"]))
        proc = await _start()
        try:
            died = loop.create_future()
            proc.on_dead = died.set_result
            last = proc.stats
            stop_process(proc.proc)  # the take is never answered
            assert await proc.fresh_stats(wait_s=0.05) is last
            proc.proc.kill()
            await asyncio.wait_for(died, 30)
            await asyncio.sleep(0.1)  # the take's failure reaches its asyncio future
            gc.collect()
            return reported
        finally:
            proc.shutdown()

    assert asyncio.run(run()) == []
