"""Request migration: a request whose worker fails under it goes on elsewhere.

A worker that crashes, becomes unreachable or starts draining answers the router with
UNAVAILABLE, whether it was running the request's prefill, pulling its KV or streaming its
tokens. Nothing the client already holds is lost: the router sends the request again, to other
workers when there are any, as a *continuation*: the prompt plus the output tokens already
streamed (``resume_token_ids``). The new worker recomputes their KV (as after a preemption) and
samples from output number ``len(resume_token_ids)`` on, so max_tokens, stop conditions and
seeded sampling (keyed by seed and output index) continue where they stopped, and greedy output
equals the uninterrupted run's. The client sees one unbroken stream; its final usage counts the
``migrations``.

Only UNAVAILABLE moves a request: INVALID_ARGUMENT would fail again anywhere,
RESOURCE_EXHAUSTED is the cluster's back-pressure, and DEADLINE_EXCEEDED and CANCELLED are the
client's own (but for the CANCELLED a stopping worker's gRPC server ends a call with that no
handler took yet, which is the worker's refusal: engine/call_abort.py's ``was_refused``).
``--migration-limit`` bounds the moves per request. A worker's refusal before it did any of
the request (draining, or its engine dead, since the router last heard of it; the worker
says so, engine/call_abort.py's REFUSED_KEY) moves it without spending one, once per
worker: nothing was lost, and a rolling restart's race must not fail requests.

Pacing: a failure whose worker still answers its probe was no crash, and what caused it (in a
chaos soak, a decode worker refusing every pull while Redis came back empty) may well cause
the next attempt's too: moved at once, a request spent its migrations within milliseconds and
failed where a short wait would have served it. Such a move waits first:
``--migration-backoff-s`` the first time, doubling each time after, jittered so that requests
failed together do not all come back together, never past the request's deadline. A worker
that no longer answers (or is draining) is skipped by every request from then on, so the move
away from it goes at once. The wait holds nothing: the failed attempt's calls are closed and
its lease release sent, and a cancel or the deadline ends the request where it waits.
"""
from __future__ import annotations

import asyncio
import random
import secrets
from dataclasses import dataclass, field

import grpc

from client.errors import never_handled
from protos import router_pb2
from router.directory import WorkerHandle
from router.errors import RouterRejectError

# A paced move waits at most 2**MAX_DOUBLINGS times --migration-backoff-s.
MAX_DOUBLINGS = 4


@dataclass
class RequestRun:
    """One client request across its attempts: what was streamed and what it cost."""

    request_id: str
    prompt_token_ids: list[int]
    t0: float
    # Output tokens streamed to the client so far, over every attempt.
    emitted: list[int] = field(default_factory=list)
    # Output the client had before this call (GenerateRequest.resume_token_ids: a client that
    # lost its router continues on another).
    resumed: list[int] = field(default_factory=list)
    migrations: int = 0
    # Attempts after the first: migrations, and moves after a worker refused the request.
    retries: int = 0
    # Workers that failed this request: a continuation goes elsewhere when it can.
    failed: set[str] = field(default_factory=set)
    # Workers that refused it before doing any of it (draining, engine stopped): each may send
    # it on once without spending a migration (router/service.py's _migrate).
    refused_by: set[str] = field(default_factory=set)
    # Workers only the next attempt avoids (besides ``failed``): the one that answered for a
    # failure blamed on another (router/service.py's _migrate).
    avoid_next: set[str] = field(default_factory=set)
    # Moves that waited first (pacing): each one waits twice as long as the one before.
    paced: int = 0
    # The workers the current attempt called, in order; the last is the one that answered
    # UNAVAILABLE, though the cause may be an earlier one (a decode worker cannot pull the KV
    # from a prefill worker that died).
    workers: list[WorkerHandle] = field(default_factory=list)
    timings: router_pb2.RequestTimings = field(default_factory=router_pb2.RequestTimings)
    # Whether a decode leg reported its timings (the first one does; continuations do not).
    decode_timed: bool = False
    usage: router_pb2.Usage = field(default_factory=router_pb2.Usage)
    # Which of the request's n sequences this is: sequence 0's routing is the request's in
    # the router's counters.
    index: int = 0
    # The prompt plus the max_tokens the client set (0 when it set none): checked against
    # max_model_len until the request starts (router/directory.py's check_prompt_fits).
    requested_len: int = 0

    # Makes the ids the workers see this request's alone: client-chosen request ids are unique
    # per router only, and a release by id must never free another request's lease.
    nonce: str = field(default_factory=lambda: secrets.token_hex(4))

    @property
    def attempt_id(self) -> str:
        """The id workers know this attempt by. Each retry (a migration, or a move after a
        refusal) gets its own: a failed attempt's id may still be held (a lease not yet
        released, a stream not yet torn down) on a worker that is fine."""
        if self.retries == 0:
            return f"{self.request_id}~{self.nonce}"
        return f"{self.request_id}~{self.nonce}.m{self.retries}"

    def calls(self, worker: WorkerHandle) -> WorkerHandle:
        self.workers.append(worker)
        return worker

    @property
    def output_so_far(self) -> list[int]:
        """What a continuation resumes from: the client's output before this call and since."""
        return self.resumed + self.emitted

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_so_far

    @property
    def started(self) -> bool:
        """True once this call streamed a token: the first token's timings are set for good."""
        return bool(self.emitted)


def is_migratable(exc: BaseException) -> bool:
    """A worker's failure another worker may recover from: UNAVAILABLE, or a call its
    stopping server ended CANCELLED before any handler took it (the router's own cancels
    raise CancelledError in the router, never a status)."""
    return isinstance(exc, grpc.aio.AioRpcError) and (
        exc.code() == grpc.StatusCode.UNAVAILABLE or never_handled(exc))


def backoff_s(base_s: float, paced: int) -> float:
    """The wait before a request's move after ``paced`` earlier waits."""
    return base_s * 2 ** min(paced, MAX_DOUBLINGS) * random.uniform(0.5, 1.0)


async def wait_to_move(delay_s: float, time_left: float | None) -> None:
    """Waits ``delay_s`` before a move; one that would reach the request's deadline
    (``time_left`` seconds away; None: none) ends it DEADLINE_EXCEEDED there, as any other
    wait of the request would (the client's own deadline may cancel it a moment sooner)."""
    if time_left is None or delay_s < time_left:
        await asyncio.sleep(delay_s)
        return
    await asyncio.sleep(max(time_left, 0.0))
    raise RouterRejectError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded")
