"""The requests a router has in flight, for its operator: RouterAdmin.ListRequests shows them,
RouterAdmin.CancelRequest ends one. Also where a request id already in flight is refused
(ALREADY_EXISTS), since the workers key every request by it."""
from __future__ import annotations

import asyncio
import contextlib
import time
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass

import grpc

from client.failover import MAX_REQUEST_ID_CHARS
from protos import router_pb2
from router.errors import RouterRejectError
from router.migration import RequestRun
from router.write_watch import WriteWatch

# Control characters (Cc) would let an id forge lines in the access log; format characters
# (Cf: U+202E turns the text after it around, zero-width ones hide) and the line and paragraph
# separators (Zl, Zp: U+2028 ends a line in many viewers) would let it pass for another id in a
# log or a terminal.
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Zl", "Zp"})


def check_request_id(request_id: str) -> str:
    """A client's request id, or ValueError (INVALID_ARGUMENT): bounded in length, and without
    control, format or line-separator characters."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise ValueError(f"request_id is {len(request_id)} characters; at most "
                         f"{MAX_REQUEST_ID_CHARS}")
    bad = next((c for c in request_id if unicodedata.category(c) in _REFUSED_CATEGORIES), None)
    if bad is not None:
        raise ValueError(f"request_id has control characters (U+{ord(bad):04X})")
    return request_id


# How long CancelRequest lets a chunk's write finish before it gives the write up.
WRITE_GRACE_S = 1.0


class OperatorCancelled(RouterRejectError):
    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.CANCELLED, "cancelled by the router's operator")


@dataclass(eq=False)
class InflightRequest:
    request_id: str
    # Its sequences (several with SamplingParams.n > 1).
    runs: list[RequestRun]
    # The RPC handler's task: cancelling it is what a client's cancel does.
    task: asyncio.Task
    received: float  # time.monotonic()
    cancelled: bool = False  # by CancelRequest
    # The handler has handed a chunk to gRPC, which is writing it (see cancel).
    writing: bool = False
    task_cancelled: bool = False
    finished: bool = False
    # Generate's writes to its client (None: the handler writes nothing, as Complete).
    writes: WriteWatch | None = None

    def cancel_task(self) -> None:
        if not self.finished:
            self.task_cancelled = True
            self.task.cancel()

    def cut_write(self) -> None:
        """A write still under way after the grace (a client that stopped reading) is given
        up: the call ends with the operator's CANCELLED, which the client reads after the
        output it had not read. Cancelling the handler's task there would end the call with
        no status at all."""
        if not self.finished and self.writes is not None:
            self.writes.give_up(OperatorCancelled())  # none if past it: it saw the flag

    def info(self, now: float) -> router_pb2.RequestInfo:
        run = self.runs[0]  # its phase and workers stand for the request's
        info = router_pb2.RequestInfo(
            request_id=self.request_id, age_s=now - self.received, phase="routing",
            prompt_tokens=len(run.prompt_token_ids),
            output_tokens=sum(len(r.output_so_far) for r in self.runs),
            migrations=sum(r.migrations for r in self.runs))
        for worker in run.workers:  # the current attempt's, in call order
            info.phase = worker.info.role
            if worker.info.role == "prefill":
                info.prefill_worker_id = worker.info.worker_id
            else:
                info.decode_worker_id = worker.info.worker_id
        if info.decode_worker_id and not info.prefill_worker_id \
                and run.usage.prefill_worker_id == info.decode_worker_id:
            # A local prefill: the decode worker runs the prompt too, until its first token.
            info.prefill_worker_id = info.decode_worker_id
            if not run.started:
                info.phase = "prefill"
        return info


class InflightRequests:
    def __init__(self) -> None:
        self._by_id: dict[str, InflightRequest] = {}

    @contextlib.contextmanager
    def track(self, request_id: str, runs: list[RequestRun],
              writes: WriteWatch | None = None) -> Iterator[InflightRequest]:
        """Registers the request for the current task's lifetime in this block. ``writes``:
        the handler's writes of its chunks, if it writes them."""
        if request_id in self._by_id:
            raise RouterRejectError(grpc.StatusCode.ALREADY_EXISTS,
                                    f"request id {request_id!r} is already in flight")
        entry = InflightRequest(request_id, runs, asyncio.current_task(), time.monotonic(),
                                writes=writes)
        self._by_id[request_id] = entry
        try:
            yield entry
        finally:
            entry.finished = True
            del self._by_id[request_id]

    def list(self) -> list[router_pb2.RequestInfo]:
        now = time.monotonic()
        entries = sorted(self._by_id.values(), key=lambda e: e.received)
        return [e.info(now) for e in entries]

    def cancel(self, request_id: str) -> bool:
        """Cancels the request's handler; False when no such request is in flight."""
        entry = self._by_id.get(request_id)
        if entry is None:
            return False
        entry.cancelled = True
        if entry.writing:
            # grpc.aio takes a cancel of the handler's task during its write for the client's
            # and ends the RPC with no status: the client would wait out its deadline. The
            # handler sees the flag when the write returns; a write that does not (a client
            # that stopped reading) is given up after a grace period.
            asyncio.get_running_loop().call_later(WRITE_GRACE_S, entry.cut_write)
        else:
            entry.cancel_task()
        return True

    def __len__(self) -> int:
        return len(self._by_id)
