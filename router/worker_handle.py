"""The router's handle on one worker: its registry entry, one channel reused across requests,
and the router's own counts of what it sent there."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from protos import common_pb2, worker_pb2_grpc
from router.decode_mux import DecodeMux
from router.liveness import LivenessConfig, WatchedCalls


def worker_stub(channel, role: str):
    """The service stub of a worker of ``role`` on ``channel`` (sync or aio): both roles
    answer GetWorkerInfo, each under its own service's name."""
    if role not in ("prefill", "decode"):
        raise ValueError(f"role must be prefill or decode, got {role!r}")
    return (worker_pb2_grpc.PrefillWorkerStub if role == "prefill"
            else worker_pb2_grpc.DecodeWorkerStub)(channel)


@dataclass(eq=False)
class WorkerHandle:
    info: common_pb2.WorkerInfo
    channel: grpc.aio.Channel
    prefill_stub: worker_pb2_grpc.PrefillWorkerStub
    decode_stub: worker_pb2_grpc.DecodeWorkerStub
    inflight: int = 0
    routed: int = 0
    # Prompts this router sent a decode worker to prefill itself, not yet past their first
    # token: the local-prefill policy weighs them against the prefill worker's queue.
    prefilling: int = 0
    # The calls in flight to this worker, which a liveness cut fails (router/liveness.py),
    # and how many holders want it health-checked (its calls, and KV pulls from it).
    calls: WatchedCalls = field(default_factory=WatchedCalls)
    watchers: int = 0
    # Requests using its channel (WorkerDirectory.in_use): a dropped worker's channel closes
    # only once none does.
    users: int = 0
    # The router's health checks, which also set the heartbeats on this worker's DecodeMany.
    liveness: LivenessConfig | None = None
    # The GetWorkerInfo call in flight to it, if any (WorkerDirectory._ask_fresh).
    asking: asyncio.Future | None = None
    # When (monotonic) a registry listing last held it: before a Redis restart, or since.
    listed_at: float = 0.0
    _mux: DecodeMux | None = None

    @property
    def worker_id(self) -> str:
        return self.info.worker_id

    @property
    def mux(self) -> DecodeMux:
        """This decode worker's shared DecodeMany stream (router/decode_mux.py)."""
        if self._mux is None:
            self._mux = DecodeMux(self.decode_stub, self.worker_id, self.calls, self.liveness)
        return self._mux

    async def close(self) -> None:
        if self._mux is not None:
            await self._mux.close()
        await self.channel.close()



@contextlib.contextmanager
def prefilling(worker: WorkerHandle):
    """Counts a local prefill on ``worker`` until the block exits (its first token came, or it
    failed)."""
    worker.prefilling += 1
    try:
        yield
    finally:
        worker.prefilling -= 1


class CountedStream:
    """An async generator's items, with ``release`` (of a worker's in-flight count, taken when
    the worker was picked: ``WorkerDirectory.hold_inflight``) called once the generator ends,
    fails or is closed. Counting from the pick, not from the generator's first step: its body
    runs only once iterated, a loop turn or more later, and requests picking in one loop turn
    (a batch of prefills answered together) would each find the others' picks uncounted and
    all take the worker that looked idlest. Close it (``contextlib.aclosing``) once made: one
    left unclosed keeps its count."""

    def __init__(self, release: Callable[[], None], items) -> None:
        self._release: Callable[[], None] | None = release
        self._items = items

    def __aiter__(self) -> CountedStream:
        return self

    async def __anext__(self):
        try:
            return await self._items.__anext__()
        except BaseException:  # StopAsyncIteration, or the error that ended the generator
            self._end()
            raise

    async def aclose(self) -> None:
        try:
            await self._items.aclose()
        finally:
            self._end()

    def _end(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()
