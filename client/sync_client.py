"""The blocking client: the same calls as AsyncClient, on plain gRPC channels."""
from __future__ import annotations

import itertools
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence

import grpc

from client.channels import call_metadata, open_channels
from client.errors import (CLIENT_CLOSED, CancelledError, DeadlineExceededError,
                           error_from_rpc)
from client.failover import (Attempts, FailoverPolicy, attempt_request, check_addresses,
                             check_timeout, take_chunk)
from client.liveness import CheckThread, Peer, cut_router
from client.types import (Chat, Completion, GenerationChunk, ModelIdentity, ModelInfo, Prompt,
                          Tokenized, build_request, completion_from_proto,
                          detokenize_request, model_info_from_proto, tokenize_request)
from protos import router_pb2, router_pb2_grpc

# How often wait_ready looks at its channel's readiness (it wakes at once for close()).
_READY_POLL_S = 0.05


class Client:
    """``with Client("host:port") as c: for chunk in c.generate("Hi"): ...``

    Closing the iterator of ``generate`` early (``break`` or ``.close()``) cancels the call.
    Several router addresses, failover and health checks of busy routers (from a thread of
    the client's own), as in AsyncClient.
    """

    def __init__(self, address: str | Sequence[str], *, timeout: float | None = None,
                 failover: FailoverPolicy = FailoverPolicy(), api_key: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None) -> None:
        self.addresses = check_addresses(address)
        self.address = self.addresses[0]
        self.timeout = check_timeout(timeout)
        self.failover = failover
        self._metadata = call_metadata(api_key)
        self._channels = open_channels(self.addresses, failover, tls, root_certificates,
                                       aio=False)
        self._stubs = [router_pb2_grpc.RouterStub(c) for c in self._channels]
        self._routers = [Peer(a, c) for a, c in zip(self.addresses, self._channels)]
        self._next = itertools.count()
        self._closed = False
        # Set by close(): wakes a call waiting in a failover backoff, in any thread.
        self._closing = threading.Event()
        # A forked child inherits the channels, but their calls and threads are the parent's.
        self._pid = os.getpid()
        self._checks = None
        if failover.health_check_interval_s:
            self._checks = CheckThread(failover.health_check_interval_s,
                                       failover.health_check_misses, self._routers, cut_router)
            self._checks.start()
        # A client dropped without close() must not leave its health-check thread, which
        # holds the channels, running for the rest of the process.
        self._finalizer = weakref.finalize(self, _release, self._pid, self._checks,
                                           self._channels)

    def _attempts(self, timeout: float | None) -> Attempts:
        return Attempts(self.failover, len(self._stubs), next(self._next) % len(self._stubs),
                        timeout if timeout is not None else self.timeout)

    def generate(self, prompt: Prompt, *, request_id: str | None = None,
                 timeout: float | None = None,
                 expect_model: ModelIdentity | None = None,
                 **sampling) -> Iterator[GenerationChunk]:
        # Bad arguments raise here, not at the first next().
        req = build_request(prompt, request_id, sampling, expect_model)
        check_timeout(timeout)
        return self._stream(req, timeout)

    def _stream(self, req, timeout: float | None) -> Iterator[GenerationChunk]:
        # The deadline starts with the call, at the first next(), as AsyncClient's does: not
        # when the iterator was made (streams made ahead and read in turn timed out unread).
        tries = self._attempts(timeout)
        tries.track(req)
        received: list[int] = []
        while True:
            self._check_open()
            call = self._invoke(lambda: self._stubs[tries.router].Generate(
                attempt_request(req, received, tries.retries, tries.model),
                timeout=tries.remaining(), metadata=self._metadata))
            try:
                with self._routers[tries.router].calls.watch(call) as cut:
                    try:
                        for msg in call:
                            yield take_chunk(msg, received, tries)
                            self._check_fork()  # an iterator read on in a forked child
                        tries.ended()
                        return
                    except grpc.RpcError:
                        if cut.reason is not None:  # cancelled by the health checks
                            raise cut.error() from None
                        raise
            except grpc.RpcError as e:
                if tries.complete:  # all of it arrived: a continuation would generate more
                    return
                self._raise_if_closed(e)
                delay = tries.after(e)
                if delay is None:
                    raise error_from_rpc(e, tries.note(e)) from None
            finally:
                if self._pid == os.getpid():  # a child's cancel of the parent's call hangs
                    call.cancel()
            self._closing.wait(delay)  # close() ends the wait; the next attempt then raises

    def complete(self, prompt: Prompt, *, request_id: str | None = None,
                 timeout: float | None = None,
                 expect_model: ModelIdentity | None = None, **sampling) -> Completion:
        req = build_request(prompt, request_id, sampling, expect_model)
        tries = self._attempts(timeout)
        msg = self._unary("Complete", lambda n: attempt_request(req, [], n), tries)
        return completion_from_proto(msg, req.request_id, tries.moves,
                                     req.sampling.HasField("prompt_logprobs"))

    def tokenize(self, prompt: str | list | Chat, *, timeout: float | None = None) -> Tokenized:
        """The token ids Generate would send for a text or a chat (its template applied)."""
        req = tokenize_request(prompt)
        msg = self._unary("Tokenize", lambda n: req, self._attempts(timeout))
        return Tokenized(list(msg.token_ids), msg.max_model_len)

    def detokenize(self, token_ids: list[int], *, skip_special_tokens: bool = True,
                   timeout: float | None = None) -> str:
        req = detokenize_request(token_ids, skip_special_tokens)
        return self._unary("Detokenize", lambda n: req, self._attempts(timeout)).text

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        """The model the routers serve: limits, chat template, sampling defaults."""
        return model_info_from_proto(self._unary(
            "GetModelInfo", lambda n: router_pb2.ModelInfoRequest(), self._attempts(timeout)))

    def _unary(self, method: str, request_for: Callable[[int], object], tries: Attempts):
        """One unary call (on a future, so that the health checks can cut it), tried again on
        the next router while it fails over (``request_for(retries)``: each attempt's)."""
        while True:
            self._check_open()
            fut = self._invoke(lambda: getattr(self._stubs[tries.router], method).future(
                request_for(tries.retries), timeout=tries.remaining(), metadata=self._metadata))
            try:
                with self._routers[tries.router].calls.watch(fut) as cut:
                    try:
                        return fut.result()
                    except grpc.FutureCancelledError:
                        if cut.reason is None:
                            raise
                        raise cut.error() from None
            except grpc.RpcError as e:
                self._raise_if_closed(e)
                delay = tries.after(e)
                if delay is None:
                    raise error_from_rpc(e) from None
            finally:
                # No-op once finished. Otherwise (KeyboardInterrupt, any other exception) the
                # router would hold the call for as long as the traceback is kept (a REPL's
                # sys.last_traceback): the future is cancelled only when collected.
                fut.cancel()
            self._closing.wait(delay)

    def wait_ready(self, timeout: float | None = 30.0) -> None:
        """Waits until the first router's channel connects: DeadlineExceededError after
        ``timeout`` seconds (None: no limit), checked as a call's (a NaN never ran out)."""
        check_timeout(timeout)
        self._check_open()
        ready = grpc.channel_ready_future(self._channels[0])
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            # In slices: a channel that close() (another thread) shuts never makes the
            # future ready, and the caller would wait out its whole timeout.
            while not ready.done():
                left = _READY_POLL_S if deadline is None else deadline - time.monotonic()
                if self._closing.wait(min(_READY_POLL_S, max(left, 0))):
                    raise RuntimeError("this Client is closed")
                if deadline is not None and time.monotonic() >= deadline:
                    raise DeadlineExceededError(
                        f"router {self.address} not reachable in {timeout}s")
        finally:
            ready.cancel()  # no-op once ready; else it stops watching the channel

    def close(self) -> None:
        self._closed = True
        self._closing.set()
        self._finalizer()

    def _raise_if_closed(self, e: grpc.RpcError) -> None:
        """A call close() cut (its channel shut under it) says so, as AsyncClient's does, not
        gRPC's "Stream removed (Channel closed!)"."""
        if self._closed and e.code() == grpc.StatusCode.CANCELLED:
            raise CancelledError(CLIENT_CLOSED) from None

    def _check_open(self) -> None:
        self._check_fork()
        if self._closed:  # its channels would raise gRPC's own ValueError
            raise RuntimeError("this Client is closed")

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # the channels' calls and threads are the parent's
            raise RuntimeError("this Client was made before fork(); make a new one in the "
                               "child process")

    def _invoke(self, start):
        """``start()``, a call on a channel: one that close() (another thread) shut after
        ``_check_open`` raises the SDK's error, not gRPC's ValueError."""
        try:
            return start()
        except ValueError:
            if self._closed:
                raise RuntimeError("this Client is closed") from None
            raise

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release(pid: int, checks: CheckThread | None, channels: list) -> None:
    # In a forked child (its exit runs the finalizer too) the channels' calls are the
    # parent's: closing them there waits forever. The parent closes them.
    if os.getpid() != pid:
        return
    if checks is not None:
        checks.stop()
    for channel in channels:
        channel.close()
