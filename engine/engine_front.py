"""What a service sees of its engine: requests in, one asyncio queue of outputs per request.

Two engines stand behind this face: ``AsyncEngine`` (engine/async_engine.py) steps in a thread
of the service's own process; ``EngineProcess`` (engine/engine_client.py) steps in a process of
its own, so the service's event loop and the engine's step never wait for one GIL. The streams,
their aborts when a caller leaves early, and the failure of every stream when the engine dies
are the same for both, and live here.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from engine.outputs import EngineStats, KVAllocation, RequestOutput
from engine.sampling_params import SamplingParams

# How long fresh_stats() waits for a running step before answering with the last step's stats.
FRESH_STATS_WAIT_S = 0.25
# What shutdown() takes at worst (the engine thread's: engine.async_engine; the engine
# process's stop waits as long). A service's stop is its drain, the gRPC server's stop grace,
# then this: the launcher's stop grace (router.launcher) covers all three.
SHUTDOWN_TIMEOUT_S = 12.0


class EngineDeadError(RuntimeError):
    """The engine stopped (a step raised, its process exited, or it was shut down)."""


class EngineStepTimeout(RuntimeError):
    """A step ran past the step timeout: the engine is taken as wedged (a hung device or
    collective) and dies as if the step had raised."""


@dataclass
class _Stream:
    queue: asyncio.Queue
    finished: bool = False


class EngineFront:
    """The loop side. Subclasses submit work to their engine (``_add_request``,
    ``_add_prefilled``, ``_commit``, ``abort``) and feed ``_deliver`` with its outputs."""

    def __init__(self, loop: asyncio.AbstractEventLoop,
                 on_dead: Callable[[BaseException], None] | None) -> None:
        self.loop = loop
        # Called on the loop once the engine died of a failure (not at shutdown), after every
        # waiting stream got EngineDeadError.
        self.on_dead = on_dead
        self.error: BaseException | None = None
        self.stats: EngineStats | None = None
        self._streams: dict[str, _Stream] = {}
        # Ids the engine holds for a caller here, until the request's last output reaches this
        # loop: allocated (decode role) or admitted. The engine frees an aborted request's id
        # before that output arrives, and a new request taking the id meanwhile would get it
        # (its stream ended at once, the request left decoding for nobody).
        self._held: set[str] = set()

    # --- what subclasses provide ------------------------------------------------------------
    @property
    def alive(self) -> bool:
        raise NotImplementedError

    @property
    def num_leased(self) -> int:
        """Requests whose KV the engine holds for a reader (prefill role), as a drain waits
        for them: also once the engine died, when no step refreshes ``stats``."""
        raise NotImplementedError

    async def _add_request(self, request_id: str, prompt_token_ids: list[int],
                           params: SamplingParams, resume_token_ids: list[int],
                           stream_interval: int) -> None:
        raise NotImplementedError

    def _add_prefilled(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                       params: SamplingParams, resume_token_ids: list[int],
                       stream_interval: int) -> Awaitable[KVAllocation]:
        raise NotImplementedError

    def _commit(self, request_id: str) -> Awaitable[None]:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        """Frees the request's blocks (at once when idle, else at the next step)."""
        raise NotImplementedError

    # --- outputs in, failures out -----------------------------------------------------------
    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            if out.finished or out.kv_lease is not None:  # its last output here
                self._held.discard(out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.queue.put_nowait(out)

    def _fail_all(self) -> None:
        self._held.clear()  # no output comes any more
        for stream in self._streams.values():
            stream.queue.put_nowait(self._dead())

    def _dead(self) -> EngineDeadError:
        return EngineDeadError(f"the engine stopped: {self.error!r}" if self.error
                               else "the engine is shut down")

    def _check_alive(self) -> None:
        if not self.alive:
            raise self._dead()

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # --- requests ---------------------------------------------------------------------------
    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, resume_token_ids: list[int] = (),
                       stream_interval: int = 1) -> AsyncIterator[RequestOutput]:
        """Queues a request and yields its outputs; leaving early aborts it (blocks freed).
        ``resume_token_ids``, ``stream_interval``: see ``LLMEngine.add_request`` (an interval
        of N also wakes this loop once per N steps for the request, not every step)."""
        stream = await self._admit(request_id, lambda: self._add_request(
            request_id, prompt_token_ids, params, resume_token_ids, stream_interval))
        async with contextlib.aclosing(self._drain(request_id, stream)) as outs:
            async for out in outs:
                yield out

    async def allocate_prefilled(self, request_id: str, prompt_token_ids: list[int],
                                 first_token_id: int, params: SamplingParams,
                                 resume_token_ids: list[int] = (),
                                 stream_interval: int = 1) -> KVAllocation:
        """Decode role: blocks for a prompt whose KV arrives from outside."""
        self._check_alive()
        self._check_free(request_id)  # before any block is taken for it
        self._held.add(request_id)
        return await self._guarded(request_id, self._add_prefilled(
            request_id, prompt_token_ids, first_token_id, params, resume_token_ids,
            stream_interval))

    async def commit_prefilled(self, request_id: str) -> AsyncIterator[RequestOutput]:
        """Decode role: admits the request; yields its outputs; leaving early aborts it."""
        stream = await self._admit(request_id, lambda: self._guarded(
            request_id, self._commit(request_id), release_on_failure=False), allocated=True)
        # Closed with the caller's iterator: else the stream and its abort wait for the
        # loop's generator finalizer (the id refused, the request decoded for nobody).
        async with contextlib.aclosing(self._drain(request_id, stream)) as outs:
            async for out in outs:
                yield out

    async def _admit(self, request_id: str, admit: Callable[[], Awaitable],
                     allocated: bool = False) -> _Stream:
        """The request's stream, opened before ``admit()`` puts the request in the engine (its
        outputs may come before that returns), and closed again if that fails. ``allocated``:
        the id is held by its own allocation (allocate_prefilled)."""
        self._check_alive()
        stream = self._open(request_id, allocated)
        # Held from before the engine has it: its last output may come before admit() returns.
        self._held.add(request_id)
        try:
            await admit()
        except BaseException as e:
            self._streams.pop(request_id, None)
            # Not in the engine, unless its own allocation holds it, or a cancel left the
            # admission to finish (then _guarded aborts it, and its last output frees the id).
            if not allocated and not isinstance(e, asyncio.CancelledError):
                self._held.discard(request_id)
            raise
        return stream

    async def _guarded(self, request_id: str, work: Awaitable, release_on_failure: bool = True):
        """``work``, which waits for the running step. A caller cancelled meanwhile (client
        cancel, deadline) cannot stop it, so once it has allocated or admitted the request, the
        request is aborted: no blocks stay held, no steps decode for nobody. The id, held by
        the caller, is let go if ``work`` fails and ``release_on_failure``."""
        job = asyncio.ensure_future(work)
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(lambda f: self._settle(request_id, f, release_on_failure))
            raise
        except BaseException:
            if release_on_failure:
                self._held.discard(request_id)
            raise

    def _settle(self, request_id: str, job: asyncio.Future, release_on_failure: bool) -> None:
        """A guarded job its caller stopped waiting for, now done."""
        if job.cancelled() or job.exception() is not None:
            if release_on_failure:
                self._held.discard(request_id)
        else:
            self.abort(request_id)  # the id stays held until its aborted output arrives

    def _check_free(self, request_id: str, allocated: bool = False) -> None:
        # Checked here, not only by the engine: the running request's stream must stay, and
        # the engine frees an id before its last output reaches this loop (see _held).
        # ``allocated``: held by the caller's own allocation, which is no conflict.
        if request_id in self._streams or (request_id in self._held and not allocated):
            raise ValueError(f"request id {request_id!r} is already in the engine")

    def _open(self, request_id: str, allocated: bool = False) -> _Stream:
        self._check_free(request_id, allocated)
        stream = _Stream(asyncio.Queue())
        self._streams[request_id] = stream
        return stream

    async def _drain(self, request_id: str, stream: _Stream) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished or item.kv_lease is not None:
                    stream.finished = True
                yield item
                if stream.finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not stream.finished:
                self.abort(request_id)
