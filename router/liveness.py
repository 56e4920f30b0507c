"""The router's health checks of its workers (client/liveness.py has the why and the how).

A worker with calls on it, or with a request's KV being pulled from it, is checked every
``interval_s``; one that leaves ``misses`` checks in a row unanswered is taken as hung: the
calls on it fail with UNAVAILABLE, which migrates them (router/migration.py), and it gets no
new requests until the registry drops it or it registers anew (router/directory.py). Idle
workers are left to the registry's heartbeats.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from client.liveness import (WatchedCalls, check_health_checks, check_loop,
                             watched_stream, watched_unary)
from engine.call_abort import KV_SOURCE_FAILED

__all__ = ["KVSourceCut", "LivenessConfig", "WatchedCalls", "check_loop",
           "first_while_watched", "watched_stream", "watched_unary"]


class KVSourceCut(grpc.aio.AioRpcError):
    """The router's own cut of a decode leg whose KV source it took as hung, marked as that
    source's failure for the migration to blame. Unlike a decode worker's own answer with the
    mark, it says nothing of that worker's pull: one-sided reads from a worker whose event
    loop stalls go on, and the decode worker learns of the cut only from its cancel."""

    def __init__(self, reason: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(),
                         grpc.aio.Metadata(*KV_SOURCE_FAILED), details=reason)


@dataclass(frozen=True)
class LivenessConfig:
    # Seconds between health checks of a worker with calls on it (each check's timeout too);
    # 0 turns the checks off (a hung worker is then found by keepalive alone).
    interval_s: float = 2.0
    # Checks in a row left unanswered before the worker is taken as hung.
    misses: int = 3

    def __post_init__(self) -> None:
        check_health_checks(self.interval_s, self.misses)

    @property
    def enabled(self) -> bool:
        return self.interval_s > 0


async def first_while_watched(calls: WatchedCalls, chunks: AsyncIterator):
    """The first item of ``chunks`` (None if it ends first), or UNAVAILABLE when ``calls``
    are cut meanwhile. For a decode leg pulling its KV from that worker: a pull from a hung
    worker would wait out its whole timeout. Leaving early cancels the wait for the item."""
    lost = asyncio.get_running_loop().create_future()
    key, cut = calls.add(lambda _reason: lost.done() or lost.set_result(None))
    first = asyncio.ensure_future(anext(chunks, None))
    try:
        await asyncio.wait((first, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        calls.remove(key)
        if not first.done():
            first.cancel()
            # The leg's cleanup (its cancel to the decode worker) runs. Waited, not awaited:
            # awaiting the cancelled task raises CancelledError, which would hide the
            # caller's own cancel landing meanwhile (a migration instead of the cancel).
            await asyncio.wait({first})
        if not first.cancelled():
            # Read now: a caller cancelled as the item failed (a deadline ends both the
            # handler and the leg in one loop turn) never asks, and asyncio would log it.
            first.exception()
    if cut.reason is not None and first.cancelled():
        # The KV's source hung, not the decode worker reading it: the migration blames it.
        raise KVSourceCut(cut.reason)
    return first.result()
