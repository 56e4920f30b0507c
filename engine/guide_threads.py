"""Guide builds (a schema's compile, a pattern's automaton, the vocabulary's trie) on threads
of their own.

A schema's compile may take up to its work budget (engine/compile_budget.py, ~2 s of a core),
and a client can send many at once. On an event loop's default executor (6 threads on 2 cores)
six of them held every thread that the router's prompts tokenize in, or that a worker's
prefilled requests are added and committed in, so everyone's requests waited on them. Here
they queue behind each other on ``GUIDE_THREADS`` threads, and a build whose request is
cancelled before its turn never runs. Used by the router's check (``check_guide_off_loop``),
and by an engine before it adds a request whose guide it has not built (engine/engine_proc.py,
engine/async_engine.py).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from engine.guides import check_guide
from engine.sampling_params import SamplingParams

T = TypeVar("T")

# The compile is pure Python: more threads than this would only share the GIL.
GUIDE_THREADS = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(GUIDE_THREADS, thread_name_prefix="pdserve-guide")
        return _pool


async def on_guide_thread(fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` on the guide threads."""
    return await asyncio.get_running_loop().run_in_executor(_executor(), fn, *args)


async def check_guide_off_loop(params: SamplingParams) -> None:
    """``check_guide(params)`` on the guide threads: ValueError when the request's pattern or
    schema cannot guide."""
    await on_guide_thread(check_guide, params)
