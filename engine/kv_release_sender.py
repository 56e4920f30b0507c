"""Release notifications sent off the pull's thread: a failed pull's word to its owner.

A decode worker whose pull failed tells the owner its read is over (engine/kv_connector.py).
Sent on the pull's thread, that word held the pull's error back for as long as the owner took
to answer: over the torch backend, 10 s for an owner that accepts no connection (a stopped
process, a host gone off the network; measured on the 2-core VM), during which the request
could not fail over and the thread served no other pull. Here the pull hands it over and
raises at once.

Bounded both ways: at most ``MAX_PENDING`` notifications wait, and at most ``MAX_SENDERS``
threads send, one owner at a time each, so an owner that never answers holds one thread
while the others keep telling live owners. A send that fails drops the rest of that owner's
batch: they would wait out the same timeout one after the other, and an owner that cannot be
told frees its blocks at the lease's expiry anyway. Threads start when there is work and end
when there is none.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable

from engine.thread_names import named_thread
from kvtransfer import KVAgentHandle

logger = logging.getLogger(__name__)

# Failed pulls outstanding at once are bounded by the decode worker's pull threads; this is
# far beyond them, so a drop means owners stopped answering long ago.
MAX_PENDING = 1024
# Owners told in parallel: more hung owners than this at once delay live owners' releases
# by one notification timeout, never the pulls.
MAX_SENDERS = 4
# What close() waits for sends under way (to live owners they take milliseconds); a send
# stuck on a hung owner ends with its own timeout, or when the agent closes.
CLOSE_WAIT_S = 2.0


class ReleaseSender:
    """Sends ``send(owner, msg)`` calls on background threads, in order per owner."""

    def __init__(self, send: Callable[[KVAgentHandle, bytes], None],
                 name: str = "pdserve-kv-notify") -> None:
        self._send = send
        self._name = name
        self._cond = threading.Condition()
        # owner agent name -> (its handle, messages not yet sent), oldest owner first
        self._pending: OrderedDict[str, tuple[KVAgentHandle, list[bytes]]] = OrderedDict()
        self._num_pending = 0
        self._busy: set[str] = set()  # owners a thread is telling now
        self._threads: set[threading.Thread] = set()
        self._closed = False
        self.num_dropped = 0

    def submit(self, owner: KVAgentHandle, msg: bytes) -> bool:
        """Queues ``msg`` for ``owner``; False when it was dropped (closed, or full)."""
        with self._cond:
            if self._closed or self._num_pending >= MAX_PENDING:
                self.num_dropped += 1
                full = not self._closed
            else:
                full = None
                _, msgs = self._pending.setdefault(owner.agent_name, (owner, []))
                msgs.append(msg)
                self._num_pending += 1
                self._start_sender()
        if full:
            logger.warning("%d KV release notifications wait already: %r goes unsent, its "
                           "lease ends at its expiry", MAX_PENDING, msg)
        return full is None

    def num_pending(self) -> int:
        """Notifications queued or being sent."""
        with self._cond:
            return self._num_pending

    def _start_sender(self) -> None:
        idle = len(self._threads) - len(self._busy)
        waiting = sum(1 for n in self._pending if n not in self._busy)
        if waiting > idle and len(self._threads) < MAX_SENDERS:
            t = named_thread(self._run, self._name)
            self._threads.add(t)
            t.start()

    def _next(self) -> tuple[KVAgentHandle, list[bytes]] | None:
        for name in self._pending:
            if name not in self._busy:
                self._busy.add(name)
                return self._pending.pop(name)
        return None

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                job = None if self._closed else self._next()
                if job is None:
                    self._threads.discard(me)
                    self._cond.notify_all()
                    return
            owner, msgs = job
            sent = 0
            try:
                for msg in msgs:
                    self._send(owner, msg)
                    sent += 1
            except Exception as e:  # noqa: BLE001 - the owner is gone or hung: its leases expire
                logger.debug("could not tell KV owner %r that %d failed pulls are over: %r",
                             owner.agent_name, len(msgs) - sent, e)
            finally:
                with self._cond:
                    self._busy.discard(owner.agent_name)
                    self._num_pending -= len(msgs)
                    self._cond.notify_all()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Drops what no thread took yet, and waits up to ``wait_s`` for sends under way."""
        with self._cond:
            self._closed = True
            for _, msgs in self._pending.values():
                self._num_pending -= len(msgs)
                self.num_dropped += len(msgs)
            self._pending.clear()
            self._cond.wait_for(lambda: not self._threads, timeout=wait_s)
