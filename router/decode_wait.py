"""Waiting for room on a decode worker once a prompt is prefilled.

After a remote prefill the client already holds the first token, so a decode worker's
RESOURCE_EXHAUSTED (no free KV blocks, or its pending-request limit) would end a stream that
has begun. Such a refusal is usually brief: the router chose the worker on a free-blocks view
that lags, and a burst of prefilled prompts can reach one worker together while its running
requests are about to finish. The prefill worker meanwhile holds the prompt's KV under its
lease, so nothing is lost by waiting: the router tries again, with backoff, for a decode worker
with room, preferring the others, for at most ``--decode-wait-timeout-s``, and never past the
client's deadline or so close to the lease's end that the pull could outlive it. Waiting holds
the prefill worker's blocks, which is how a full decode tier pushes back on prefill, where a
refusal comes before the client has any token.
"""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import grpc

from router.directory import NoWorkerError

# The pull must start at least this long before the prefill lease ends.
LEASE_MARGIN_S = 2.0
FIRST_DELAY_S = 0.01
MAX_DELAY_S = 0.25


def is_decode_full(exc: BaseException) -> bool:
    """A decode worker's (or the directory's) refusal for want of room."""
    if isinstance(exc, NoWorkerError):
        return exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    return (isinstance(exc, grpc.aio.AioRpcError)
            and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED)


@dataclass
class DecodeWait:
    """One prefilled request's wait for a decode worker: how long it may last and has lasted."""

    until: float  # time.monotonic() past which a refusal goes to the client
    started: float
    delay: float = FIRST_DELAY_S
    retries: int = 0

    @classmethod
    def after_prefill(cls, wait_timeout_s: float, lease_timeout_s: float,
                      deadline_remaining: float | None) -> DecodeWait:
        """``lease_timeout_s``: what the prefill worker's KV handle said was left of it."""
        now = time.monotonic()
        budget = min(wait_timeout_s, lease_timeout_s - LEASE_MARGIN_S)
        if deadline_remaining is not None:
            budget = min(budget, deadline_remaining)
        return cls(until=now + max(budget, 0.0), started=now)

    @property
    def waited_s(self) -> float:
        return time.monotonic() - self.started if self.retries else 0.0

    async def backoff(self, exc: BaseException) -> None:
        """Sleeps before the next try, or raises ``exc`` when it is not a refusal for room or
        no time is left for another try."""
        if not is_decode_full(exc):
            raise exc
        # Jittered, so that requests refused together do not all come back together.
        delay = self.delay * random.uniform(0.5, 1.0)
        if time.monotonic() + delay >= self.until:
            raise exc
        self.retries += 1
        self.delay = min(self.delay * 2, MAX_DELAY_S)
        await asyncio.sleep(delay)
