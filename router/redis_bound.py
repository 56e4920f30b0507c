"""Every call the router and the workers make to Redis is bounded by time.

Bounded here rather than by redis-py's ``socket_timeout``: with it, redis-py awaits each
write through ``asyncio.wait_for``, which on Python 3.11 swallows a cancel landing as the
write ends (client/tasks.py), and a client's cancel of a request whose router was looking up
its prefix was lost.
"""
from __future__ import annotations

import asyncio
import functools
import math
import os

import redis.exceptions

# A test-only hook, not a setting: tests/test_ledger_recovery.py starts a router while Redis
# hangs, and that router's start waits out four bounded calls in turn (20 s at the default).
_TIMEOUT_ENV = "PDSERVE_TEST_REDIS_TIMEOUT_S"


def _timeout_s() -> float:
    raw = os.environ.get(_TIMEOUT_ENV)
    if raw is None:
        return 5.0
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0 < value < 3600:
        raise ValueError(f"{_TIMEOUT_ENV}={raw!r}: a number of seconds above 0 and below 3600")
    return value


REDIS_TIMEOUT_S = _timeout_s()


def bounded(method):
    """At most REDIS_TIMEOUT_S for the whole call, so a Redis that stopped answering fails it
    (the callers retry or give up) instead of holding a heartbeat, a routing decision, an
    admin listing or a worker's stop forever."""
    @functools.wraps(method)
    async def call(self, *args, **kwargs):
        try:
            async with asyncio.timeout(REDIS_TIMEOUT_S):
                return await method(self, *args, **kwargs)
        except TimeoutError:
            raise redis.exceptions.TimeoutError(
                f"Redis did not answer {method.__name__} within {REDIS_TIMEOUT_S} s") from None
    return call
