"""The asyncio client: one channel per router, reused for every call, until close()."""
from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from client.channels import call_metadata, check_root_certificates, open_channels
from client.errors import DeadlineExceededError, error_from_rpc
from client.failover import (Attempts, FailoverPolicy, attempt_request, check_addresses,
                             check_timeout, take_chunk)
from client.liveness import Peer, check_loop, cut_router, watched_stream, watched_unary
from client.tasks import stop_task
from client.types import (Chat, Completion, GenerationChunk, ModelIdentity, ModelInfo, Prompt,
                          Tokenized, build_request, completion_from_proto,
                          detokenize_request, model_info_from_proto, tokenize_request)
from protos import router_pb2, router_pb2_grpc

# How long close() from another thread waits for the client's loop to close its channels.
_FOREIGN_CLOSE_S = 5.0


class AsyncClient:
    """``async with AsyncClient("host:port") as c: async for chunk in c.generate("Hi"): ...``

    ``timeout`` (seconds) is a per-call deadline that the router passes on to the workers;
    leaving a ``generate`` loop early cancels the call, and the workers free its KV blocks.
    Several router addresses spread requests over the routers, and a request whose router
    fails goes on on another (client/failover.py); ``failover`` tunes or (max_retries=0) stops
    that. ``api_key``: the router's ``--api-key``; ``tls`` (or ``root_certificates``, PEM bytes
    of the CA that signed the router's certificate) connects over TLS (client/channels.py).
    A router with calls on it that stops answering health checks has them cut, and they fail
    over (client/liveness.py). A prompt is text, token ids, or a conversation (a list of
    ``{"role": ..., "content": ...}`` messages, or a ``Chat``) that the router renders with
    the model's chat template. Its channels open on the event loop of its first call and
    serve that loop only (grpc.aio's channels belong to one loop): one client per loop.
    """

    def __init__(self, address: str | Sequence[str], *, timeout: float | None = None,
                 failover: FailoverPolicy = FailoverPolicy(), api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None) -> None:
        self.addresses = check_addresses(address)
        self.address = self.addresses[0]
        self.timeout = check_timeout(timeout)
        self.failover = failover
        self._metadata = call_metadata(api_key)
        check_root_certificates(root_certificates)
        self._tls = (tls, root_certificates)
        # Opened by _connect on the first call's loop: a client built outside any loop (at
        # import, before asyncio.run) must not tie its channels to another one.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._channels: list = []
        self._stubs: list = []
        self._routers: list[Peer] = []
        self._next = itertools.count()
        self._closed = False
        # Set by close() (on the client's loop): wakes the calls waiting in a failover backoff.
        self._closing: asyncio.Event | None = None
        # Two loops' first calls at once must not both open channels (one set would leak).
        self._connect_lock = threading.Lock()
        # A forked child inherits the channels, but their calls are the parent's.
        self._pid = os.getpid()
        # The health checks' task (in a box the finalizer shares).
        self._checks_box: list[asyncio.Task | None] = [None]

    def _check_open(self) -> None:
        if self._pid != os.getpid():  # the channels' calls are the parent's
            raise RuntimeError("this AsyncClient was made before fork(); make a new one in the "
                               "child process")
        if self._closed:  # its channels would raise grpc's UsageError
            raise RuntimeError("this AsyncClient is closed")

    def _connect(self) -> None:
        self._check_open()
        loop = asyncio.get_running_loop()
        if self._loop is loop:
            return
        with self._connect_lock:
            self._check_open()  # close() (another thread) may have run meanwhile
            if self._loop is not None and self._loop is not loop:
                raise RuntimeError("this AsyncClient's channels belong to the event loop of "
                                   "its first call; use a client per event loop (one per "
                                   "asyncio.run)")
            if self._loop is None:
                self._open(loop)

    def _open(self, loop: asyncio.AbstractEventLoop) -> None:
        self._closing = asyncio.Event()
        self._channels = open_channels(self.addresses, self.failover, *self._tls, aio=True)
        self._stubs = [router_pb2_grpc.RouterStub(c) for c in self._channels]
        self._routers = [Peer(a, c) for a, c in zip(self.addresses, self._channels)]
        self._loop = loop
        # A client dropped without close() must not leave its health checks running on the
        # loop for good (the task holds the routers, not the client).
        weakref.finalize(self, _cancel_soon, loop, self._checks_box)

    def _watch(self, i: int) -> Peer:
        """Router ``i``, with the health checks of busy routers running on the client's loop
        (the one ``_connect`` bound it to)."""
        interval = self.failover.health_check_interval_s
        if interval and not self._closed and (self._checks is None or self._checks.done()):
            routers = self._routers
            self._checks = self._loop.create_task(check_loop(
                interval, self.failover.health_check_misses,
                lambda: [r for r in routers if len(r.calls)], cut_router))
        return self._routers[i]

    @property
    def _checks(self) -> asyncio.Task | None:
        return self._checks_box[0]

    @_checks.setter
    def _checks(self, task: asyncio.Task | None) -> None:
        self._checks_box[0] = task

    def _attempts(self, timeout: float | None) -> Attempts:
        self._connect()
        return Attempts(self.failover, len(self._stubs), next(self._next) % len(self._stubs),
                        timeout if timeout is not None else self.timeout)

    async def generate(self, prompt: Prompt, *, request_id: str | None = None,
                       timeout: float | None = None,
                       expect_model: ModelIdentity | None = None,
                       **sampling) -> AsyncIterator[GenerationChunk]:
        req = build_request(prompt, request_id, sampling, expect_model)
        tries = self._attempts(timeout)
        tries.track(req)
        received: list[int] = []
        while True:
            self._check_open()  # close() during the backoff
            with self._closed_as_ours():
                call = self._stubs[tries.router].Generate(
                    attempt_request(req, received, tries.retries, tries.model),
                    timeout=tries.remaining(), metadata=self._metadata)
            # Leaving early cancels the call, which frees the request on the router.
            msgs = watched_stream(self._watch(tries.router).calls, call)
            try:
                async with contextlib.aclosing(msgs):
                    async for msg in msgs:
                        yield take_chunk(msg, received, tries)
                tries.ended()
                return
            except grpc.RpcError as e:
                if tries.complete:  # all of it arrived: a continuation would generate more
                    return
                delay = tries.after(e)
                if delay is None:
                    raise error_from_rpc(e, tries.note(e)) from None
            await self._backoff(delay)

    async def complete(self, prompt: Prompt, *, request_id: str | None = None,
                       timeout: float | None = None,
                       expect_model: ModelIdentity | None = None, **sampling) -> Completion:
        req = build_request(prompt, request_id, sampling, expect_model)
        tries = self._attempts(timeout)
        msg = await self._unary("Complete", lambda n: attempt_request(req, [], n), tries)
        return completion_from_proto(msg, req.request_id, tries.moves,
                                     req.sampling.HasField("prompt_logprobs"))

    async def tokenize(self, prompt: str | list | Chat, *,
                       timeout: float | None = None) -> Tokenized:
        """The token ids Generate would send for a text or a chat (its template applied)."""
        req = tokenize_request(prompt)
        msg = await self._unary("Tokenize", lambda n: req, self._attempts(timeout))
        return Tokenized(list(msg.token_ids), msg.max_model_len)

    async def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = True,
                         timeout: float | None = None) -> str:
        req = detokenize_request(token_ids, skip_special_tokens)
        return (await self._unary("Detokenize", lambda n: req, self._attempts(timeout))).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model the routers serve: limits, chat template, sampling defaults."""
        msg = await self._unary("GetModelInfo", lambda n: router_pb2.ModelInfoRequest(),
                                self._attempts(timeout))
        return model_info_from_proto(msg)

    async def _unary(self, method: str, request_for: Callable[[int], object], tries: Attempts):
        """One unary call, tried again on the next router while it fails over
        (``request_for(retries)`` is the request of each attempt)."""
        while True:
            self._check_open()  # close() during the backoff
            try:
                with self._closed_as_ours():
                    call = getattr(self._stubs[tries.router], method)(
                        request_for(tries.retries), timeout=tries.remaining(),
                        metadata=self._metadata)
                return await watched_unary(self._watch(tries.router).calls, call)
            except grpc.RpcError as e:
                delay = tries.after(e)
                if delay is None:
                    raise error_from_rpc(e) from None
                await self._backoff(delay)

    async def _backoff(self, delay: float) -> None:
        """Waits ``delay`` s before the next attempt, or until close()."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(delay):  # not wait_for: client/tasks.py
                await self._closing.wait()

    async def wait_ready(self, timeout: float | None = 30.0) -> None:
        """Waits until the first router's channel connects: DeadlineExceededError after
        ``timeout`` seconds (None: no limit), checked as a call's."""
        check_timeout(timeout)
        self._connect()
        try:
            async with asyncio.timeout(timeout):  # not wait_for: client/tasks.py
                with self._closed_as_ours():
                    await self._channels[0].channel_ready()
        except TimeoutError:
            raise DeadlineExceededError(f"router {self.address} not reachable in {timeout}s") \
                from None

    async def close(self) -> None:
        with self._connect_lock:  # a _connect in another thread opens no channels after this
            self._closed = True
        if self._pid != os.getpid():
            return  # the channels and the task are the parent's, which closes them
        loop = self._loop
        if loop is not None and loop is not asyncio.get_running_loop() and loop.is_running():
            # From another thread: grpc.aio's channels and calls, and the checks' task, are
            # their loop's (cancelling them from here is a race, which asyncio's debug mode
            # refuses), so they are closed there. Bounded: a loop that stops before it runs
            # the close leaves it to this thread.
            with contextlib.suppress(RuntimeError):  # that loop closed meanwhile
                there = asyncio.run_coroutine_threadsafe(self._shut(), loop)
                done, _ = await asyncio.wait({asyncio.wrap_future(there)},
                                             timeout=_FOREIGN_CLOSE_S)
                if done:
                    return done.pop().result()
        await self._shut()

    async def _shut(self) -> None:
        self._wake()
        checks, self._checks = self._checks, None
        if checks is not None:
            if checks.get_loop() is asyncio.get_running_loop():
                await stop_task(checks)
            else:  # its loop runs no more (else close() would run this there)
                checks.cancel()
        for channel in self._channels:
            await channel.close()

    @contextlib.contextmanager
    def _closed_as_ours(self):
        """A call started, or a channel waited on, after close() (another thread) shut the
        channels under ``_check_open``: the SDK's error, not grpc's UsageError."""
        try:
            yield
        except grpc.aio.UsageError:
            if self._closed:
                raise RuntimeError("this AsyncClient is closed") from None
            raise

    def _wake(self) -> None:
        """Ends the backoff waits, on the loop the event belongs to."""
        if self._closing is None:
            return
        if self._loop is asyncio.get_running_loop():
            self._closing.set()
        else:
            with contextlib.suppress(RuntimeError):  # that loop is closed: nothing waits
                self._loop.call_soon_threadsafe(self._closing.set)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _cancel_soon(loop: asyncio.AbstractEventLoop, checks_box: list) -> None:
    """Cancels a dropped client's health checks from whichever thread collects it."""
    task = checks_box[0]
    if task is not None and not task.done():
        with contextlib.suppress(RuntimeError):  # the loop is closed: so is the task
            loop.call_soon_threadsafe(task.cancel)
