"""Stopping an asyncio task for sure (the SDK's background checks, the services' loops).

On Python 3.11 ``asyncio.wait_for`` swallows a cancellation that arrives just as the future it
waits on completes (CPython gh-86296; 3.12 rebuilt ``wait_for`` on ``asyncio.timeout``), and
redis-py with a ``socket_timeout`` awaits its writes through it. A loop of Redis calls here
ignored 64 of 100 cancels sent to it, and a router whose registry-refresh loop lost its cancel
never finished stopping (SIGTERM, then nothing, for 20 minutes, until killed). The Registry
now bounds its calls itself (router/registry.py) and its cancels land; a task that must end is
still cancelled again until it has, whatever it awaits, and the services' loops also check a
stop flag each round.
"""
from __future__ import annotations

import asyncio
import logging

logger = logging.getLogger(__name__)

# A task that swallowed a cancel gets another after this long; short cleanups (none of the
# loops stopped this way has a long one) finish well within it.
RECANCEL_S = 0.25


async def stop_task(task: asyncio.Task | None, timeout_s: float = 5.0) -> bool:
    """Cancels ``task`` until it ends, for at most ``timeout_s``; whether it ended. What it
    ended with (its result, cancellation or exception) is dropped: its owner is stopping."""
    if task is None:
        return True
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            logger.warning("task %s did not stop within %.1f s of being cancelled",
                           task.get_name(), timeout_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(RECANCEL_S, remaining))
    if not task.cancelled():
        task.exception()  # retrieved, so asyncio does not log it as never retrieved
    return True
