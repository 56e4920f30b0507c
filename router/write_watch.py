"""The router's writes to a Generate client, and the cut of a client that takes none.

A chunk's write waits for the client's HTTP/2 window: a client that stopped reading with its
connection open, or whose host went away without closing it (with the window shut nothing
goes out for TCP to find it gone), held the request for ever when it set no deadline: the
router kept its output as the worker made it, and its place among --max-inflight-requests.
A write not done --client-write-timeout-s after it began is given up: the request ends (its
worker's part cancelled, if any is left), and the call's status waits behind the output the
client did not read (grpc sends it once the client reads on, or drops it with the
connection). grpc tells nothing of a write's progress, so a chunk larger than the client's
link carries in that time is given up too, though the client reads it (measured: a 40 MiB
chunk over a 4 MB/s link, read throughout, cut by a 2 s timeout): set the timeout well past
the largest chunk's transfer time on the slowest client link.
An operator's cancel (RouterAdmin.CancelRequest) gives up a write it finds stuck the same
way (router/inflight.py).
"""
from __future__ import annotations

import asyncio

import grpc

from engine.call_abort import write_message
from router.errors import RouterRejectError


class ClientStalled(RouterRejectError):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(grpc.StatusCode.CANCELLED,
                         f"the router cancelled the stream: a chunk of its output waited "
                         f"{timeout_s:g} s for the client to take it (--client-write-timeout-s)")


class WriteWatch:
    """Writes of one call's messages, watched by one timer for the call (not one per write:
    it looks at the write under way when it fires). ``timeout_s`` 0: not watched."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        # Why the write under way was given up (the call ends with it); None: it was not.
        self.cut: RouterRejectError | None = None
        self._since: float | None = None  # when the write under way began (loop clock)
        self._task = asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._timer = self._loop.call_later(timeout_s, self._check) if timeout_s else None

    async def write(self, context: grpc.aio.ServicerContext, message) -> None:
        self._since = self._loop.time()
        try:
            await write_message(context, message)
        except asyncio.CancelledError:
            if self.cut is None:
                raise  # the call's own: its client's cancel, its deadline, the server's stop
            # Not the call's cancel: grpc.aio would end it with no status, which the client,
            # reading on, would wait for until its deadline, or for ever.
            self._task.uncancel()
            raise self.cut from None
        finally:
            self._since = None

    def give_up(self, why: RouterRejectError) -> None:
        """Cancels the write under way, which then raises ``why`` (the call's status); none
        when the handler is past it, or it was given up already."""
        if self._since is None or self.cut is not None:
            return
        # The task is in the write (or just back from it, and the cancel lands there).
        self.cut = why
        self._task.cancel()

    def _check(self) -> None:
        now = self._loop.time()
        if self._since is not None and now - self._since >= self.timeout_s:
            self.give_up(ClientStalled(self.timeout_s))
            return
        due = self._since + self.timeout_s if self._since is not None else now + self.timeout_s
        self._timer = self._loop.call_at(due, self._check)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
