"""Guide builds run on threads of their own (engine/guide_threads.py): many slow router checks
at once leave the default executor, which prompts tokenize in, free; they run GUIDE_THREADS at
a time; a refusal reaches the caller; a check cancelled in the queue never runs; an in-process
engine builds a new guide there before it adds the request. Through a real router:
tests/test_serving.py (bad guides get INVALID_ARGUMENT); in an engine process:
tests/test_engine_process_faults.py."""
from __future__ import annotations

import asyncio
import re
import threading

import pytest

from engine import guide_threads
from engine.guide_threads import GUIDE_THREADS, check_guide_off_loop
from engine.sampling_params import SamplingParams

WAIT_S = 30  # a bound on each wait, so that a regression fails instead of hanging


class _SlowChecks:
    """check_guide stand-in: each call blocks until released, and records its thread."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.threads: list[str] = []
        self.running = 0
        self.most_running = 0

    def __call__(self, params: SamplingParams) -> None:
        with self.lock:
            self.threads.append(threading.current_thread().name)
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            assert self.release.wait(WAIT_S)
        finally:
            with self.lock:
                self.running -= 1


def test_slow_checks_queue_on_their_own_threads_and_leave_the_default_executor_free(
        monkeypatch):
    slow = _SlowChecks()
    monkeypatch.setattr(guide_threads, "check_guide", slow)

    async def run() -> str:
        params = SamplingParams(guided_regex="a+")
        # More than any default executor has threads (at most 32).
        checks = [asyncio.create_task(check_guide_off_loop(params)) for _ in range(40)]
        try:
            while len(slow.threads) < GUIDE_THREADS:
                await asyncio.sleep(0.01)
            # A prompt's tokenization (asyncio.to_thread) runs while they all wait.
            tokenized = await asyncio.wait_for(asyncio.to_thread(lambda: "tokenized"), WAIT_S)
        finally:
            slow.release.set()
        await asyncio.wait_for(asyncio.gather(*checks), WAIT_S)
        return tokenized

    assert asyncio.run(run()) == "tokenized"
    assert len(slow.threads) == 40
    assert all(name.startswith("pdserve-guide") for name in slow.threads)
    assert slow.most_running == GUIDE_THREADS


def test_a_check_cancelled_before_its_turn_never_runs(monkeypatch):
    slow = _SlowChecks()
    monkeypatch.setattr(guide_threads, "check_guide", slow)

    async def run() -> None:
        params = SamplingParams(guided_regex="a+")
        running = [asyncio.create_task(check_guide_off_loop(params))
                   for _ in range(GUIDE_THREADS)]
        while len(slow.threads) < GUIDE_THREADS:
            await asyncio.sleep(0.01)
        queued = asyncio.create_task(check_guide_off_loop(params))
        await asyncio.sleep(0)
        queued.cancel()
        with pytest.raises(asyncio.CancelledError):
            await queued
        slow.release.set()
        await asyncio.wait_for(asyncio.gather(*running), WAIT_S)
        # One more check: it runs after where the cancelled one would have.
        await asyncio.wait_for(check_guide_off_loop(params), WAIT_S)

    asyncio.run(run())
    assert len(slow.threads) == GUIDE_THREADS + 1


def test_a_refused_guide_reaches_the_caller_and_a_good_one_passes():
    async def run() -> None:
        await check_guide_off_loop(SamplingParams(guided_json={"type": "integer"}))
        with pytest.raises(ValueError, match="lookahead"):
            await check_guide_off_loop(SamplingParams(guided_regex="a(?=b)"))
        with pytest.raises(ValueError, match="'pattern' at #/properties/a"):
            await check_guide_off_loop(SamplingParams(guided_json={
                "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}))

    asyncio.run(run())


def test_an_in_process_engine_builds_a_new_guide_on_a_guide_thread(monkeypatch):
    from engine import guided_regex
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    built_on: list[str] = []
    init = guided_regex.TokenGuide.__init__

    def recorded(self, *args, **kwargs):
        built_on.append(threading.current_thread().name)
        init(self, *args, **kwargs)
    monkeypatch.setattr(guided_regex.TokenGuide, "__init__", recorded)
    params = SamplingParams(max_tokens=12, temperature=0.0, guided_regex=r"[a-c]{2,5}")

    async def run():
        engine = AsyncEngine(await asyncio.to_thread(
            LLMEngine, EngineConfig("micro-llama", num_gpu_blocks=64)))
        try:
            first = [o async for o in engine.generate("a", [5, 6, 7], params)]
            again = [o async for o in engine.generate("b", [8, 9], params)]  # built already
            return first, again
        finally:
            engine.shutdown()

    first, again = asyncio.run(run())
    assert len(built_on) == 1 and built_on[0].startswith("pdserve-guide")
    for outs in (first, again):
        assert re.fullmatch(params.guided_regex, outs[-1].text) and outs[-1].finished
