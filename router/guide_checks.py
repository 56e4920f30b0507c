"""The router's guide checks (engine/guides.check_guide) on threads of their own.

A schema's compile may take up to its work budget (engine/compile_budget.py, ~2 s of a core),
and a client can send many at once. On the event loop's default executor (6 threads on 2
cores) six of them held every thread that prompts tokenize in and chat templates are sent
from, so everyone's requests waited on them. Here they queue behind each other on
``GUIDE_CHECK_THREADS`` threads, and a check whose request is cancelled before its turn never
runs.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from engine.guides import check_guide
from engine.sampling_params import SamplingParams

# The compile is pure Python: more threads than this would only share the GIL.
GUIDE_CHECK_THREADS = 2

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(GUIDE_CHECK_THREADS, thread_name_prefix="pdserve-guide")
        return _pool


async def check_guide_off_loop(params: SamplingParams) -> None:
    """``check_guide(params)`` on the guide threads: ValueError when the request's pattern or
    schema cannot guide."""
    await asyncio.get_running_loop().run_in_executor(_executor(), check_guide, params)
