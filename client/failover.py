"""Router failover for the SDK: several routers, and requests that survive losing one.

A client built with several router addresses sends each new request to the next one in turn.
A call that fails with UNAVAILABLE (the router is down or restarting, or it has no worker to
offer right now), that a stopping router ended before taking it (client/errors.py's
``never_handled``), or a stream closed before its final chunk (cut short), is tried again, on
the next router, after a short back-off once every router was tried: from scratch when nothing
had arrived, else as a continuation of the prompt and the tokens already received
(``GenerateRequest.resume_token_ids``), so the stream the caller reads goes on without a gap or
a repeat. The caller's deadline bounds every attempt together. Other statuses are the caller's
to see at once.
"""
from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from client.errors import never_handled
from client.keepalive import check_keepalive, keepalive_options
from client.liveness import check_health_checks, rpc_error
from client.types import GenerationChunk, chunk_from_proto
from protos import router_pb2

RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)
# Trailing metadata of a router's UNAVAILABLE for a request that moved between workers as
# often as its --migration-limit allows: another attempt would be a new request, with a new
# budget, so the SDK gives up (each move recomputes the whole context, which the limit bounds).
MIGRATIONS_SPENT_KEY = "pdserve-migrations-spent"
# Trailing metadata of a router's FAILED_PRECONDITION for a request that expects another model
# (GenerateRequest.expect_model): a continuation goes on on another router, if one serves the
# stream's model, and never again on this one.
MODEL_MISMATCH_KEY = "pdserve-model-mismatch"
# What a stream closed OK before its final chunk fails with (Attempts.ended).
UNFINISHED = "the stream ended without a finish reason (cut short)"


@dataclass(frozen=True)
class FailoverPolicy:
    # Attempts after the first, per request; 0 turns failover off.
    max_retries: int = 3
    # Waited before a round of attempts that starts again at a router already tried (a lone
    # router restarting needs a moment), doubling up to max_backoff_s.
    backoff_s: float = 0.5
    max_backoff_s: float = 4.0
    # Every router connection is pinged this often, and one that leaves a ping unanswered for
    # keepalive_timeout_s is closed: a router that hangs without closing the connection (a
    # stopped process, a host gone) then fails its calls with UNAVAILABLE, which fail over,
    # instead of holding them until their deadlines. None: no pings.
    keepalive_time_s: float | None = 10.0
    keepalive_timeout_s: float = 20.0
    # A router with calls on it is asked for its health this often (0: never), and one that
    # leaves health_check_misses checks in a row unanswered is taken as hung: its calls are
    # cut and fail over (client/liveness.py). They also find a router whose gRPC answers
    # pings while its event loop is stuck.
    health_check_interval_s: float = 2.0
    health_check_misses: int = 3

    def __post_init__(self) -> None:
        if not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError("backoff_s must be in [0, max_backoff_s]")
        if self.keepalive_time_s is not None:
            check_keepalive("keepalive_time_s", self.keepalive_time_s)
        check_keepalive("keepalive_timeout_s", self.keepalive_timeout_s)
        check_health_checks(self.health_check_interval_s, self.health_check_misses)

    def channel_options(self) -> list[tuple[str, int]]:
        """The keepalive part of every router channel's options (client/keepalive.py)."""
        if self.keepalive_time_s is None:
            return []
        return keepalive_options(self.keepalive_time_s, self.keepalive_timeout_s)


# gRPC turns a deadline past ~1e10 s into one already passed: every call failed at once.
MAX_TIMEOUT_S = 1e8


def check_timeout(timeout: float | None) -> float | None:
    """A call's timeout: None (no deadline) or seconds in (0, MAX_TIMEOUT_S]."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
            or not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"timeout must be None (no deadline) or seconds in (0, "
                         f"{MAX_TIMEOUT_S:g}], got {timeout!r}")
    return timeout


def check_addresses(address: str | Sequence[str]) -> list[str]:
    if isinstance(address, str):
        addresses = [address]
    elif isinstance(address, Sequence):
        addresses = list(address)
    else:
        addresses = []
    if not addresses or not all(isinstance(a, str) and a for a in addresses):
        raise ValueError(f"router address(es) must be non-empty strings, got {address!r}")
    for a in addresses:
        m = _HOST_PORT.fullmatch(a)
        if m and not 0 < int(m.group(1)) <= 65535:
            raise ValueError(f"router address {a!r}: the port must be in [1, 65535]")
    return addresses


# HOST:PORT or [IPV6]:PORT, bare or after dns: (other targets, unix: ones, are gRPC's to
# parse). gRPC takes a port past 65535 modulo 65536: HOST:70000 dialled HOST:4464.
_HOST_PORT = re.compile(r"(?!(?:unix|unix-abstract|vsock):)(?:dns:(?://[^/]*/)?)?"
                        r"(?:\[[^\]]*\]|[^:\[\]/]*):(\d+)", re.ASCII)


class Attempts:
    """One request's attempts: which router, how long is left, whether to go on."""

    def __init__(self, policy: FailoverPolicy, num_routers: int, first: int,
                 timeout: float | None) -> None:
        self.policy = policy
        self.num_routers = num_routers
        self.first = first
        self.retries = 0
        # Retries after a failure (the usage's migrations): a router's refusal of the model
        # (nothing ran there) is a retry, not a move.
        self.moves = 0
        timeout = check_timeout(timeout)
        self.deadline = None if timeout is None else time.monotonic() + timeout
        # A stream of n > 1 sequences cannot continue elsewhere once it has streamed (the
        # router resumes one sequence): it fails over only while nothing has arrived.
        self.resumable = True
        self.streamed = False
        # A stream ends with one final chunk per sequence: once all have arrived, a failure
        # of the call (the router lost before it sent the closing status) ends nothing.
        self.num_sequences = 1
        self.finished: set[int] = set()
        # The request asked for prompt_logprobs and sequence 0's first chunk, which carries
        # them, is still to come (take_chunk).
        self.prompt_logprobs_due = False
        # The id the caller's chunks carry (take_chunk): the first one's.
        self.request_id: str | None = None
        # The model of the stream's first chunk: a continuation expects it (attempt_request).
        self.model: router_pb2.ModelIdentity | None = None
        # Routers (indices) that refused the stream's model: skipped from then on.
        self.foreign: set[int] = set()
        self.skipped = 0
        # Routers tried since the last pause: coming back to one of them starts a new round,
        # after a pause (foreign routers skipped, so that two routers of which one serves
        # another model still pause between tries of the other).
        self._tried: set[int] = set()
        # The next round's pause, doubled after each up to max_backoff_s: kept, not computed
        # as backoff_s * 2 ** rounds, which no float holds past 1023 rounds (OverflowError,
        # even for backoff_s=0, with the max_retries of a client that retries for good).
        self._pause = policy.backoff_s

    def track(self, req: router_pb2.GenerateRequest) -> None:
        """For a Generate stream: whether it can go on elsewhere, and what ends it."""
        self.resumable = resumable(req)
        self.num_sequences = req.sampling.n if req.sampling.HasField("n") else 1
        self.prompt_logprobs_due = req.sampling.HasField("prompt_logprobs")

    @property
    def complete(self) -> bool:
        """Every sequence's final chunk has arrived."""
        return len(self.finished) >= max(self.num_sequences, 1)

    def ended(self) -> None:
        """A stream's call closed OK. A router closes one only after every sequence's final
        chunk, so one closed before them was cut short (a fault behind it), not finished: it
        raises UNAVAILABLE, and fails over as a lost router's stream does."""
        if not self.complete:
            raise rpc_error(grpc.StatusCode.UNAVAILABLE, UNFINISHED)

    @property
    def router(self) -> int:
        return (self.first + self.retries + self.skipped) % self.num_routers

    def remaining(self) -> float | None:
        return None if self.deadline is None else max(self.deadline - time.monotonic(), 0.0)

    def after(self, error: grpc.RpcError) -> float | None:
        """After a failed attempt: seconds to wait before the next one, or None to give up."""
        foreign = has_mark(error, MODEL_MISMATCH_KEY)
        if foreign:
            self.foreign.add(self.router)
        if ((error.code() not in RETRYABLE and not foreign and not never_handled(error))
                or len(self.foreign) >= self.num_routers
                or self.retries >= self.policy.max_retries
                or has_mark(error, MIGRATIONS_SPENT_KEY)):
            return None
        if self.streamed and not self.resumable:
            return None
        self._tried.add(self.router)
        self.retries += 1
        self.moves += not foreign
        while self.router in self.foreign:
            self.skipped += 1
        delay = 0.0
        if self.router in self._tried:  # a round of routers is over
            self._tried.clear()
            delay = self._pause
            self._pause = min(self._pause * 2, self.policy.max_backoff_s)
        left = self.remaining()
        if left is not None and delay >= left:
            return None
        return delay

    def note(self, error: grpc.RpcError) -> str:
        """What the caller's exception adds to the status that ended the request: the
        routers skipped for serving another model than the stream's, if any."""
        if not self.foreign or has_mark(error, MODEL_MISMATCH_KEY):
            return ""
        return (f"{len(self.foreign)} of the client's {self.num_routers} routers serve "
                f"another model than the one this stream began with")


def has_mark(error: grpc.RpcError, key: str) -> bool:
    """Whether the router marked the call's status with ``key`` (MIGRATIONS_SPENT_KEY: the
    request's migrations are spent; MODEL_MISMATCH_KEY: it serves another model)."""
    trailing = getattr(error, "trailing_metadata", None)
    metadata = (trailing() if callable(trailing) else None) or ()
    return any(k == key for k, _ in metadata)


def resumable(req: router_pb2.GenerateRequest) -> bool:
    """Whether the request's stream can go on elsewhere (one sequence: n unset or 1)."""
    return not (req.sampling.HasField("n") and req.sampling.n > 1)


# The longest request id a router takes (router/inflight.py checks it): defined here, where
# the SDK, which never imports the router, needs it too.
MAX_REQUEST_ID_CHARS = 256


def attempt_request(req: router_pb2.GenerateRequest, received: list[int], retries: int,
                    model: router_pb2.ModelIdentity | None = None
                    ) -> router_pb2.GenerateRequest:
    """The request for attempt ``retries``: the original, then continuations. A caller's
    request id gets a suffix, since a failed attempt's may still be held downstream. A
    continuation of a stream that began (``model``: its first chunk's) expects that model:
    another router's model, or chat template, would go on with another text than the one
    begun, or read the ids received as other tokens."""
    if not retries:
        return req
    again = router_pb2.GenerateRequest()
    again.CopyFrom(req)
    again.resume_token_ids.extend(received)
    if model is not None and not req.HasField("expect_model"):
        again.expect_model.CopyFrom(model)
    if req.request_id:
        suffix = f"~r{retries}"
        # Within the router's limit on ids (router/inflight.py) even for the longest allowed.
        again.request_id = req.request_id[:MAX_REQUEST_ID_CHARS - len(suffix)] + suffix
    return again


def take_chunk(msg: router_pb2.GenerateChunk, received: list[int],
               tries: Attempts) -> GenerationChunk:
    """A streamed chunk, its tokens noted for a continuation; the final usage counts the
    client's own moves beside the router's."""
    # A continuation carries no prompt logprobs: they came with the first attempt's first
    # chunk, and the router leaves them out of a request that resumes after it.
    due = tries.prompt_logprobs_due and msg.index == 0
    if due:
        tries.prompt_logprobs_due = False
    chunk = chunk_from_proto(msg, scored_prompt=due)
    # The caller reads one request: a continuation's chunks carry the id the first attempt's
    # did (the caller's, or the one the first router chose), not the retry's.
    if tries.request_id is None:
        tries.request_id = chunk.request_id
    chunk.request_id = tries.request_id
    # The caller reads one stream, so the model once: on its first chunk.
    if tries.streamed:
        chunk.model = None
    elif msg.HasField("model"):
        tries.model = msg.model
    received.extend(chunk.token_ids)
    tries.streamed = True
    if chunk.finish_reason:
        tries.finished.add(chunk.index)
    if chunk.usage is not None:
        chunk.usage.migrations += tries.moves
    return chunk
