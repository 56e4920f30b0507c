"""Which prefill leases a decode worker is reading, and which its caller told it to forget
(``DecodeWorker.ForgetLease``).

A router that cuts a Decode call before its first chunk cannot tell whether the call reached
this worker: gRPC does not say whether a cancelled call was sent. A per-request call is cut a
millisecond or two after it was opened, often before it left; read or not, the router must
leave the lease to its reader (ReleaseKV ``may_be_read``), and a worker that never got the call
sent no word, so the blocks stayed held until the lease expired. So the router asks. Both the
question and any Decode with the lease are answered here on one event loop, so one of two
orders holds, whichever way they crossed on the wire:

- the Decode came first and is still running (``reading``): the answer is "may be reading";
  its own end tells the lease's owner (a cut before its pull: "will not read"; a pull's end,
  failed or not, releases the lease), as a multiplexed request's does;
- otherwise the lease is forgotten: a Decode with it that arrives later (overtaken on the wire,
  or queued in gRPC) is refused before any read is posted, and the router may free the lease
  at once. A Decode that ended before the question posts nothing more either.

The question can overtake the cut itself (on the multiplexed stream the cancel waits behind the
stream's other messages), and a Decode found reading may then end before its pull without a
cancel (no room, say): one that ended so, its handle verified, the last here holding a lease it
was asked about, tells the owner itself (``Reading.end``), else the router's release, left to
this worker's word, held the blocks until the lease expired. The lease is forgotten then,
as one never met is. The router asks only once done with the lease: it hands it to no one else.

A Decode counts as reading from before its handle's check until it ends, and past its end
while a pull it cut short may still be writing (decode_svc/service.py's ``_pull``).

The forgotten leases are bounded: each lasts as long as its lease could still be read (what the
router said was left of it, and a margin for the clocks), and past ``MAX_FORGOTTEN`` of them a
lease is not forgotten: the router then leaves it to the reader or the expiry, as before.
"""
from __future__ import annotations

import asyncio
import enum
import math
import time
from collections.abc import Callable

from engine.config import MAX_KV_LEASE_TIMEOUT_S
from protos import convert

# How many leases may be forgotten at once. Each is a cut whose Decode had not arrived, and
# lasts one lease: thousands a second with 60 s leases.
MAX_FORGOTTEN = 100_000
# Kept this long past what the router said was left of the lease: a Decode arriving late holds
# a handle whose lease_timeout_s counts from when the router sent it, and a decode host's clock
# behind the prefill host's lets a signed expiry pass late (decode_svc/kv_sources.py).
FORGET_MARGIN_S = 30.0


class ForgetAnswer(enum.Enum):
    """A ForgetLease answer, counted apart in the worker's stats."""

    FORGOTTEN = "forgotten"  # never met here, or done: refused from now on, freed at once
    READING = "reading"  # a Decode with it is under way: its end tells the owner
    # Never met here, but MAX_FORGOTTEN leases are forgotten already: a Decode with it is not
    # refused, so the lease is left to its reader or its expiry as a read one is.
    NO_ROOM = "no_room"

    @property
    def may_be_reading(self) -> bool:
        return self is not ForgetAnswer.FORGOTTEN


class LeaseForgotten(ValueError):
    """A Decode for a lease its caller forgot: INVALID_ARGUMENT, nothing read."""


class Reading:
    """One Decode's hold on a lease: ``end()`` once it posts no more reads."""

    def __init__(self, leases: ReadLeases, lease_id: str) -> None:
        self._leases, self.lease_id = leases, lease_id
        self._pull: asyncio.Future | None = None
        self._ended = False
        # The handle was checked: only then is a word to its owner this worker's to send (the
        # word frees whatever lease it names, and a caller must not free another's that way).
        self.verified = False
        # The owner has its word, or will: "will not read" was sent, or a pull started (its
        # end, failed or not, tells the owner the read is over).
        self.owner_told = False

    def owes_word(self) -> bool:
        """Whether the owner still waits for this Decode's word that it will not read."""
        return self.verified and not self.owner_told

    def until(self, pull: asyncio.Future) -> None:
        """Holds on until ``pull`` (a read still writing after its Decode left) is done."""
        self._pull = pull
        pull.add_done_callback(lambda _f: self.end())

    def end(self) -> bool:
        """Whether this was the last hold here on a lease a ForgetLease was answered "may be
        reading" for: its caller waits for this worker's word, which a read's own end (a pull,
        failed or not) sends, and the caller of ``end`` otherwise owes. The lease is then
        forgotten (a Decode with it still to come is refused), unless there is no room."""
        if self._ended or (self._pull is not None and not self._pull.done()):
            return False
        self._ended = True
        return self._leases._leave(self.lease_id)


class ReadLeases:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        # lease id -> Decodes holding it here (usually one)
        self._reading: dict[str, int] = {}
        # lease id -> until when a Decode with it is refused (clock), oldest first
        self._forgotten: dict[str, float] = {}
        # lease id (read here now) -> its ForgetLease's lease_timeout_s: answered "may be
        # reading", so forgotten once its last Decode here ends
        self._asked: dict[str, float] = {}

    def enter(self, lease_id: str) -> Reading:
        """A Decode's hold on ``lease_id``, before anything of it is read; raises
        LeaseForgotten for a lease forgotten here."""
        until = self._forgotten.get(lease_id)
        if until is not None:
            if until > self._clock():
                raise LeaseForgotten(f"kv_handle lease {lease_id!r} was forgotten here "
                                     "(ForgetLease): its request was cut before this call "
                                     "arrived; its KV is not read")
            del self._forgotten[lease_id]
        self._reading[lease_id] = self._reading.get(lease_id, 0) + 1
        return Reading(self, lease_id)

    def _leave(self, lease_id: str) -> bool:
        left = self._reading[lease_id] - 1
        if left:
            self._reading[lease_id] = left
            return False
        del self._reading[lease_id]
        lease_timeout_s = self._asked.pop(lease_id, None)
        return lease_timeout_s is not None and not self._remember(lease_id, lease_timeout_s)

    def forget(self, lease_id: str, lease_timeout_s: float) -> ForgetAnswer:
        """The ForgetLease answer for ``lease_id``: unless a read of it may be under way here,
        a Decode with it is refused from now on. Raises ValueError for bad input."""
        if not lease_id:
            raise ValueError("lease_id is empty")
        if len(lease_id) > convert.MAX_WORKER_REQUEST_ID_CHARS:
            raise ValueError(f"lease_id is {len(lease_id)} characters; at most "
                             f"{convert.MAX_WORKER_REQUEST_ID_CHARS}")
        if not (math.isfinite(lease_timeout_s) and 0 <= lease_timeout_s <= MAX_KV_LEASE_TIMEOUT_S):
            raise ValueError(f"lease_timeout_s must be a number in [0, "
                             f"{MAX_KV_LEASE_TIMEOUT_S:.0f}], got {lease_timeout_s}")
        if lease_id in self._reading:
            self._asked[lease_id] = max(lease_timeout_s, self._asked.get(lease_id, 0.0))
            return ForgetAnswer.READING
        if self._remember(lease_id, lease_timeout_s):
            return ForgetAnswer.NO_ROOM
        return ForgetAnswer.FORGOTTEN

    def _remember(self, lease_id: str, lease_timeout_s: float) -> bool:
        """Forgets ``lease_id``; True when there is no room to (nothing refused then)."""
        now = self._clock()
        self._drop_expired(now)
        if lease_id not in self._forgotten and len(self._forgotten) >= MAX_FORGOTTEN:
            return True  # no room to refuse its Decode: left to the reader or the expiry
        until = now + lease_timeout_s + FORGET_MARGIN_S
        self._forgotten[lease_id] = max(until, self._forgotten.pop(lease_id, until))
        return False

    def _drop_expired(self, now: float) -> None:
        # Oldest first, which is nearly soonest to end (leases differ in length): one that
        # ended behind a longer one goes when that one does, or in the sweep below.
        while self._forgotten:
            lease_id, until = next(iter(self._forgotten.items()))
            if until > now:
                break
            del self._forgotten[lease_id]
        if len(self._forgotten) >= MAX_FORGOTTEN:
            for lease_id in [k for k, u in self._forgotten.items() if u <= now]:
                del self._forgotten[lease_id]
