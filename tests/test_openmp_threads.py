"""A worker's OpenMP teams: only the engine thread keeps one (engine/openmp_threads.py).

GNU OpenMP cuts every spin wait short once the process's OpenMP threads outnumber its CPUs,
so a team left on a thread that built the engine, or started by a side job, slows every step.
These checks count the process's OS threads: a team is its worker threads.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import pytest
import torch

from engine import llm_engine
from engine.config import EngineConfig
from engine.openmp_threads import _libgomp, call_in_own_thread, use_one_openmp_thread
from engine.worker_runtime import WorkerConfig, WorkerRuntime

pytestmark = pytest.mark.skipif(_libgomp() is None, reason="torch does not run on GNU OpenMP")

# Big enough that torch splits the work into a parallel region.
_NUMEL = 1 << 22


def _os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def _team_beside_me(before: set[int]) -> set[int]:
    """OS threads started since ``before`` other than the calling one: its OpenMP team.
    (Sets of thread ids, not counts: other tests' threads may still be ending.)"""
    return _os_threads() - before - {threading.get_native_id()}


def _parallel_work() -> None:
    x = torch.ones(_NUMEL)
    torch.add(x, 1.0, out=x)


def _gone(threads: set[int], timeout_s: float = 10.0) -> bool:
    """Whether ``threads`` have all exited (threads exit asynchronously: waits up to
    ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while threads & _os_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not threads & _os_threads()


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def _thread_running(work):
    """A thread that ran ``work`` and stays alive until the block ends (its OpenMP pool, if
    any, with it); yields ``work``'s result."""
    started, stop = threading.Event(), threading.Event()
    result = []

    def side() -> None:
        result.append(work())
        started.set()
        stop.wait()

    t = threading.Thread(target=side)
    t.start()
    started.wait()
    try:
        yield result[0]
    finally:
        stop.set()
        t.join()


def test_a_thread_left_running_keeps_its_team(two_threads):
    # The hazard the helpers avoid, shown on this torch: a live thread that ran a parallel
    # region holds a pool thread beside it.
    before = _os_threads()

    def work() -> set[int]:
        _parallel_work()
        return _team_beside_me(before)

    with _thread_running(work) as team:
        assert team and team <= _os_threads()  # the team's worker lives on with the thread
    assert _gone(team)


def test_call_in_own_thread_ends_the_thread_and_its_team(two_threads):
    before = _os_threads()
    seen = {}

    def build(a, b):
        seen["thread"] = threading.current_thread()
        seen["threads"] = torch.get_num_threads()
        _parallel_work()
        seen["team"] = _team_beside_me(before)
        return a + b

    assert call_in_own_thread(build, 2, 3) == 5
    assert seen["thread"] is not threading.current_thread()
    assert seen["thread"].name == "pdserve-build" and not seen["thread"].is_alive()
    assert seen["threads"] == 2 and seen["team"]  # the build itself ran on every thread
    assert _gone(seen["team"])


def test_call_in_own_thread_raises_the_callers_error():
    def fail():
        raise KeyError("no such model")

    with pytest.raises(KeyError, match="no such model"):
        call_in_own_thread(fail)


def test_use_one_openmp_thread_pins_only_the_calling_thread(two_threads):
    before = _os_threads()

    def pinned_work() -> tuple[int, set[int]]:
        use_one_openmp_thread()
        threads = torch.get_num_threads()
        _parallel_work()
        return threads, _team_beside_me(before)

    with _thread_running(pinned_work) as (side_threads, team):
        assert side_threads == 1
        assert team == set()  # the thread alone, no team beside it
        assert torch.get_num_threads() == 2
        # A thread started now still gets the process's count (torch.set_num_threads(1)
        # would have handed 1 to it, e.g. to an engine thread not yet stepping).
        later = []
        u = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        u.start()
        u.join()
        assert later == [2]


def test_a_worker_builds_its_engine_in_a_thread_that_ends_and_pins_its_executor(
        two_threads, monkeypatch):
    seen = {}

    class Built(Exception):
        pass

    def fake_engine(config):
        seen["thread"] = threading.current_thread()
        seen["threads"] = torch.get_num_threads()
        raise Built  # stop create() here: what follows needs a real engine

    # create() imports LLMEngine when it builds an engine thread's engine.
    monkeypatch.setattr(llm_engine, "LLMEngine", fake_engine)
    cfg = WorkerConfig(engine=EngineConfig("tiny-llama", role="prefill", kv_transfer_backend="nixl"))

    async def main() -> int:
        with pytest.raises(Built):
            await WorkerRuntime.create(cfg)
        return await asyncio.to_thread(torch.get_num_threads)

    executor_threads = asyncio.run(main())
    assert seen["thread"].name == "pdserve-build" and not seen["thread"].is_alive()
    assert seen["threads"] == 2
    assert executor_threads == 1
