"""Which KV handles a decode worker reads from: with a registry, only those their prefill
worker registered and signed.

A handle names blocks of a prefill worker's cache; the decode worker pulls them and keeps them
in its prefix cache under the prompt its Decode names. Taken as given, a caller of this port
could have it read any blocks (another lease's, or a lease's under another prompt) and poison
that cache for every later request of the prompt. So each prefill worker signs its handles
(kvtransfer/handle_mac.py) with a key it publishes beside its rank handles in the registry,
and a handle that does not verify is refused (INVALID_ARGUMENT: the handle is bad input, and
the caller is no one this worker could tell apart, so PERMISSION_DENIED has nobody to name)
before a block is allocated or read. Its lease is left alone: the lease is someone else's.

A NIXL handle carries its agent's metadata, which UCX parses in this process the first time
the agent is met, and UCX checks it with assertions: a corrupted blob aborts the whole process
(measured with random byte changes: one blob in 70 to 260 failed UCX's address-version
assertion, SIGABRT), failing every request on the worker for one bad call. Prefill workers
write their handles to the registry before their first heartbeat makes them routable
(router/presence.py), so rank handles that are not byte for byte those registered came from no
prefill worker of this cluster now: they are refused before anything parses them.

A handle refused for its rank handles, or whose key cannot be read, is its source's failure
(PeerGoneError: UNAVAILABLE, the request is prefilled again elsewhere), not the caller's bad
input. The usual one is stale: a prefill worker given its --worker-id keeps it across a
restart and registers its new agents' handles, so a handle given out before the restart
differs from them, and its KV is gone. A Redis that does not answer refuses the handles of
prefill workers not met before it stopped (a key read is remembered per worker start, here or
when engine/kv_peers.py connected to the worker ahead): read unchecked, they would open the
check to whoever times a Redis outage. A handle of one met
that its remembered key does not verify, and whose key cannot be read again, is judged by the
key met: refused as not signed (INVALID_ARGUMENT), not moved as its source's failure. A worker
without a registry (driven directly, in no cluster) reads what it is given.

A handle is also refused once its lease has ended by the expiry its prefill worker signed
(``lease_expires_unix_s``): the worker's key lives as long as the worker, so a handle captured
off the network would otherwise verify for that long, after its lease had been released and
its blocks given to other prompts. That refusal is a TransferError (UNAVAILABLE, marked as the
source's failure), as the pull's own refusal of a lease too near its end has always been: the
router prefills the request again, and a legitimately expired lease is moved as it was. A
handle without an expiry (0: a prefill build before it was signed) is refused as an unsigned
one is, UNAVAILABLE: its KV could be replayed for the prefill worker's whole life.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtransfer import PeerGoneError, TransferError, handle_mac
from protos import common_pb2
from router.errors import quoted

logger = logging.getLogger(__name__)

# Keys read, remembered so that a pull asks Redis once per prefill worker start; the least
# recently used goes first.
MAX_REMEMBERED = 256
# How long a pull waits for the registry's answer before refusing the handle.
REGISTRY_WAIT_S = 1.0
# How far this host's clock may run ahead of a prefill worker's before that worker's signed
# lease expiry, which is on its own clock, cuts a pull short of what lease_timeout_s allows
# or refuses the handle. Cluster hosts keep time by NTP, milliseconds apart. A clock further
# ahead refuses a handle near its lease's end (moved, as an expired lease is); one behind lets
# a replayed handle be read that much past its lease's end. At most the pull's own margin
# (decode_svc/service.py's LEASE_READ_MARGIN_S), so that with clocks that agree no read of a
# replayed handle runs past the signed expiry.
EXPIRY_CLOCK_SKEW_S = 0.5
# Clocks this far apart (the signed expiry against what lease_timeout_s says is left, which
# the router measures on its own monotonic clock) are logged: a decode host minutes ahead
# would otherwise refuse every handle, each request prefilled again, with no word of why.
CLOCK_WARN_S = 2.0
CLOCK_WARN_EVERY_S = 60.0


class KVSources:
    def __init__(self, registry: Callable[[], object | None],
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry  # router.registry.Registry, or None without Redis
        self._clock = clock  # unix seconds, as the signed lease expiry is
        # (prefill worker id, its rank handles) -> the key it signs its KV handles with
        self._keys: OrderedDict[tuple[str, tuple[bytes, ...]], bytes] = OrderedDict()
        self._clock_warned_at = -math.inf  # time.monotonic()

    def lease_left(self, h: common_pb2.KVHandle) -> float:
        """Seconds left to read the handle's KV: what ``lease_timeout_s`` says is left of its
        lease, which is not signed (the router lowers it on the way, and so may anyone
        raise it), never past the lease's signed expiry."""
        return min(h.lease_timeout_s, self.signed_lease_left(h))

    def signed_lease_left(self, h: common_pb2.KVHandle) -> float:
        """Seconds left of the handle's lease by the expiry its prefill worker signed, with
        this host's clock allowed EXPIRY_CLOCK_SKEW_S ahead; inf for a handle without one
        (which only a worker without a registry reads)."""
        if not h.lease_expires_unix_s:
            return math.inf
        return h.lease_expires_unix_s + EXPIRY_CLOCK_SKEW_S - self._clock()

    async def check(self, h: common_pb2.KVHandle, token_ids: Sequence[int]) -> None:
        """Raises ValueError (INVALID_ARGUMENT) for a handle its prefill worker did not sign
        for the KV of ``token_ids``; PeerGoneError (UNAVAILABLE: the request moves) for one
        without a signed lease expiry, whose rank handles the worker did not register, or
        whose key cannot be read and was never met; and TransferError (UNAVAILABLE, moved)
        for one whose signed lease expiry has passed."""
        registry = self._registry()
        if registry is None:
            return
        if not h.lease_expires_unix_s:
            raise PeerGoneError(f"kv_handle of prefill worker {quoted(h.worker_id)} has no "
                                "signed lease expiry (a build before handles had one?): its "
                                "KV is not read")
        await self._verify(registry, h, token_ids)
        left = self.signed_lease_left(h)
        apart = left - EXPIRY_CLOCK_SKEW_S - h.lease_timeout_s
        if abs(apart) > CLOCK_WARN_S:
            self._warn_clocks(h, apart)
        if not left > 0:
            raise TransferError(f"the prefill worker's lease on this KV ended "
                                f"{EXPIRY_CLOCK_SKEW_S - left:.2f} s ago by its signed expiry "
                                "(a handle replayed after its lease, or this host's clock "
                                "ahead of the prefill worker's?): too late to read it")

    def _warn_clocks(self, h: common_pb2.KVHandle, apart: float) -> None:
        """``apart`` > 0: this host's clock behind the prefill worker's (or lease_timeout_s
        lowered on the way more than the time spent); < 0: ahead (or lease_timeout_s raised)."""
        now = time.monotonic()
        if now - self._clock_warned_at < CLOCK_WARN_EVERY_S:
            return
        self._clock_warned_at = now
        # Ahead and late look alike here: a handle that took long to arrive (this worker
        # paused, SIGSTOPped or starved; the call queued) has less lease left than it says.
        late = "" if apart > 0 else (", or the handle reached this worker that late (this "
                                     "process paused or overloaded, the call queued)")
        logger.warning("prefill worker %s's signed lease expiry and the handle's "
                       "lease_timeout_s disagree by %.1f s: this host's clock is %s its own%s "
                       "(keep cluster clocks in step, NTP): a clock ahead refuses handles "
                       "before their leases end, one behind reads replayed ones past theirs",
                       quoted(h.worker_id), abs(apart), "behind" if apart > 0 else "ahead of",
                       late)

    async def _verify(self, registry, h: common_pb2.KVHandle,
                      token_ids: Sequence[int]) -> None:
        source = (h.worker_id, tuple(h.rank_handles))
        met = self._keys.get(source)
        if met is not None and handle_mac.verify(met, h, token_ids):
            # Used: last to go. Kept in insertion order, a worker pulled from all along was
            # dropped after MAX_REMEMBERED other starts (each met ahead by engine/kv_peers.py
            # too), and its next pull during a Redis outage was refused and moved.
            self._keys.move_to_end(source)
            return
        # Not met, or not verified by the key met: read it again (a worker restarted under
        # its id with the same rank handles signs with a new key).
        try:
            key = await self._read_key(registry, h)
        except PeerGoneError:
            if met is None:
                raise
            # The key met is the only one there is to judge the handle by, and it fails it.
            # Moved as the source's failure, a forgery timed with a Redis outage would be
            # prefilled again elsewhere instead of refused as the bad input it is.
            raise _not_signed(h, " (the one this worker met; the registry gave no newer "
                                 "one)") from None
        if not handle_mac.verify(key, h, token_ids):
            raise _not_signed(h)
        self.remember(h.worker_id, h.rank_handles, key)

    def remember(self, worker_id: str, rank_handles: Sequence[bytes], key: bytes) -> None:
        """The key prefill worker ``worker_id`` registered with ``rank_handles``, read from the
        registry (here, or ahead by engine/kv_peers.py): its handles verify without Redis."""
        source = (worker_id, tuple(rank_handles))
        self._keys[source] = key
        self._keys.move_to_end(source)
        if len(self._keys) > MAX_REMEMBERED:
            self._keys.popitem(last=False)

    async def _read_key(self, registry, h: common_pb2.KVHandle) -> bytes:
        """The key of the handle's prefill worker, once its rank handles are those the
        worker registered."""
        try:
            async with asyncio.timeout(REGISTRY_WAIT_S):
                registered, key = await registry.kv_source(h.worker_id)
        except Exception as e:  # noqa: BLE001 - Redis away: nothing to verify with
            raise PeerGoneError(f"could not read prefill worker {quoted(h.worker_id)}'s KV "
                                f"handles from the registry ({str(e) or type(e).__name__}): "
                                "its KV is not read") from None
        if not registered:
            raise PeerGoneError(f"prefill worker {quoted(h.worker_id)} has no KV handles in the "
                                "registry: its KV is not read")
        if tuple(registered) != tuple(h.rank_handles):
            raise PeerGoneError(f"kv_handle differs from the KV handles prefill worker "
                                f"{quoted(h.worker_id)} registered (a stale handle, from "
                                "before the worker restarted?): its KV is not read")
        if not key:
            raise PeerGoneError(f"prefill worker {quoted(h.worker_id)} registered no key for "
                                "its KV handles (a build before they were signed?): its KV "
                                "is not read")
        return key


def _not_signed(h: common_pb2.KVHandle, which: str = "") -> ValueError:
    return ValueError(
        f"kv_handle mac does not verify with prefill worker {quoted(h.worker_id)}'s key{which}: "
        "its block ids, lease_id or other fields, or the request's token ids, are not those "
        "the worker signed; its KV is not read")
