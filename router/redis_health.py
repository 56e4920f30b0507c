"""Whether the router's request path should wait on Redis now.

Redis is the registry and the prefix index, not a dependency of the request path: while it
fails or hangs, requests route without it. The request path waits on Redis at most
``REDIS_SLOW_S`` (far below the registry's own bound): once any tracked call has waited that
long, Redis is taken for hung and requests skip it until it answers, and after a failed call
they skip it for ``REGISTRY_RETRY_S``. So a hung Redis costs the requests of its first
``REDIS_SLOW_S`` that much, not every request its timeout (router/directory.py). Tracked calls
are short ones (lookups, the registry listing): one that takes long on a healthy Redis (a
stale worker's purge) is no hang, and is run untracked.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

# After a failed Redis read, the request path skips Redis for this long.
REGISTRY_RETRY_S = 2.0
# A tracked Redis call unanswered this long means Redis hangs: the request path stops waiting
# (a routing decision goes without prefix hits) and skips Redis until the call ends. Far below
# the registry's own bound (REDIS_TIMEOUT_S), which every request arriving while a call hangs
# would otherwise wait out; far above a healthy lookup (a millisecond).
REDIS_SLOW_S = 1.0


class RedisHealth:
    def __init__(self) -> None:
        # Until when (monotonic) the request path routes without reading Redis.
        self._skip_until = 0.0
        # The Redis calls in flight, each with when (monotonic) it began.
        self._calls: dict[object, float] = {}
        # Whether this outage was logged: once per outage, not per request or retry window.
        self._outage_logged = False

    @property
    def ok(self) -> bool:
        """False while the request path leaves a failing or hanging Redis alone."""
        now = time.monotonic()
        return now >= self._skip_until and not any(
            now - began >= REDIS_SLOW_S for began in self._calls.values())

    def failed(self, what: str, e: Exception) -> None:
        if not self._outage_logged:
            self._outage_logged = True
            logger.warning("%s failed (%s: %s); routing on the last view of the workers, "
                           "without prefix hits, until Redis answers", what, type(e).__name__, e)
        self._skip_until = time.monotonic() + REGISTRY_RETRY_S

    def answered(self) -> None:
        if self._outage_logged:
            self._outage_logged = False
            logger.info("Redis answers again: routing with prefix hits")
        self._skip_until = 0.0

    @contextlib.contextmanager
    def _tracked(self):
        token = object()
        self._calls[token] = time.monotonic()
        try:
            yield
        finally:
            del self._calls[token]

    async def run(self, what: str, call: Callable[[], Awaitable[object]]) -> None:
        """``call()`` off the request path: bounded by the registry alone, and tracked, so
        requests skip Redis while it hangs. A failure is logged, never raised."""
        try:
            with self._tracked():
                await call()
        except Exception as e:  # noqa: BLE001 - Redis hiccup or bad entry: keep the last view
            self.failed(what, e)
        else:
            self.answered()

    async def ask(self, what: str, call: Callable[[], Awaitable[T]], otherwise: T) -> T:
        """``call()`` for the request path, or ``otherwise`` when Redis is skipped or fails.
        Given up once it has waited REDIS_SLOW_S; requests arriving once any tracked call has
        waited that long skip Redis. Its own wait, not the oldest call's: a request arriving
        late in a slow but answered call's wait was given up at once."""
        if not self.ok:
            return otherwise
        try:
            with self._tracked():
                try:
                    async with asyncio.timeout(REDIS_SLOW_S):
                        result = await call()
                except TimeoutError:
                    raise TimeoutError(f"Redis did not answer within {REDIS_SLOW_S} s") from None
        except Exception as e:  # noqa: BLE001 - any registry failure: routing goes on
            self.failed(what, e)
            return otherwise
        self.answered()
        return result
