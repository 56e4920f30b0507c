"""The router's guide checks run on threads of their own (router/guide_checks.py): many slow
checks at once leave the default executor, which prompts tokenize in, free; they run
GUIDE_CHECK_THREADS at a time; a refusal reaches the caller; a check cancelled in the queue
never runs. Through a real router: tests/test_serving.py (bad guides get INVALID_ARGUMENT)."""
from __future__ import annotations

import asyncio
import threading

import pytest

from engine.sampling_params import SamplingParams
from router import guide_checks
from router.guide_checks import GUIDE_CHECK_THREADS, check_guide_off_loop

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
    monkeypatch.setattr(guide_checks, "check_guide", slow)

    async def run() -> str:
        params = SamplingParams(guided_regex="a+")
        # More than any default executor has threads (at most 32).
        checks = [asyncio.create_task(check_guide_off_loop(params)) for _ in range(40)]
        try:
            while len(slow.threads) < GUIDE_CHECK_THREADS:
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
    assert slow.most_running == GUIDE_CHECK_THREADS


def test_a_check_cancelled_before_its_turn_never_runs(monkeypatch):
    slow = _SlowChecks()
    monkeypatch.setattr(guide_checks, "check_guide", slow)

    async def run() -> None:
        params = SamplingParams(guided_regex="a+")
        running = [asyncio.create_task(check_guide_off_loop(params))
                   for _ in range(GUIDE_CHECK_THREADS)]
        while len(slow.threads) < GUIDE_CHECK_THREADS:
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
    assert len(slow.threads) == GUIDE_CHECK_THREADS + 1


def test_a_refused_guide_reaches_the_caller_and_a_good_one_passes():
    async def run() -> None:
        await check_guide_off_loop(SamplingParams(guided_json={"type": "integer"}))
        with pytest.raises(ValueError, match="lookahead"):
            await check_guide_off_loop(SamplingParams(guided_regex="a(?=b)"))
        with pytest.raises(ValueError, match="'pattern' at #/properties/a"):
            await check_guide_off_loop(SamplingParams(guided_json={
                "type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}))

    asyncio.run(run())
