"""pdserve's threads carry their names into the OS (top -H, ps -L, /proc/PID/task/*/comm)."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from engine.thread_names import named_thread, os_thread_name


def test_os_names_drop_the_prefix_and_fit_the_kernels_limit():
    assert os_thread_name("pdserve-engine") == "engine"
    assert os_thread_name("pdserve-kv-release") == "kv-release"
    assert os_thread_name("pdserve-kv-1234-r0-abcdef12-progress") == "kv-1234-r0-abcd"
    assert os_thread_name("grpc-poller") == "grpc-poller"
    assert os_thread_name("pdserve-") == "pdserve"
    assert all(len(os_thread_name(n).encode()) <= 15 for n in ("x" * 40, "pdserve-" + "é" * 20))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_named_thread_shows_its_name_to_the_os():
    seen: list[str] = []

    def look() -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as f:
            seen.append(f.read().strip())

    t = named_thread(look, "pdserve-engine")
    assert t.name == "pdserve-engine" and t.daemon
    t.start()
    t.join()
    assert seen == ["engine"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_an_engine_thread_is_named_in_the_os():
    import asyncio

    from engine import EngineConfig, LLMEngine
    from engine.async_engine import AsyncEngine

    async def engine_thread_name() -> str:
        async_engine = AsyncEngine(LLMEngine(EngineConfig("tiny-llama", num_gpu_blocks=16)))
        try:
            # The thread names itself as it begins, which may be just after start() returns.
            comm = f"/proc/self/task/{async_engine._thread.native_id}/comm"
            deadline = time.monotonic() + 30.0
            while True:
                with open(comm) as f:
                    name = f.read().strip()
                if name == "engine" or time.monotonic() > deadline:
                    return name
                await asyncio.sleep(0.01)
        finally:
            async_engine.shutdown()

    assert asyncio.run(engine_thread_name()) == "engine"
