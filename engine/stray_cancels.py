"""A handler's own CancelledError ends its call with INTERNAL, not with silence.

grpc.aio takes any CancelledError out of a handler as the call's cancellation and sends the
caller nothing: a caller that did not cancel, whose deadline has not passed and whose server is
not stopping then waits until its deadline, or for ever without one (grpc 1.85, measured: a
unary and a streaming call both end DEADLINE_EXCEEDED after their whole timeout). pdserve's
handlers turn the cancellations they expect into statuses; this is the net under the one they
miss (a future or a call something else cancelled, awaited by the handler): the caller gets
INTERNAL naming the method, and the log the traceback (engine/handler_guards.py puts the net
under every method).

A cancellation that is the call's own (the caller's cancel, its deadline, the server's stop)
cancels the handler's task, which ``Task.cancelling()`` counts; one that is not leaves it at 0.
A write or a refusal that finds the call ended is its own too, before gRPC cancels the task
(engine/call_abort.py's CallEnded: a client that cancels while the handler's write waits for it
to read).
"""
from __future__ import annotations

import asyncio
import logging
from typing import NoReturn

import grpc

from engine.call_abort import CallEnded, abort_call

logger = logging.getLogger(__name__)


def is_stray_cancel(context: grpc.aio.ServicerContext, error: BaseException) -> bool:
    """In a handler's ``except asyncio.CancelledError``, ``error`` the one caught: whether
    nobody cancelled the call (neither its caller nor gRPC), so that gRPC would end it with no
    status."""
    if isinstance(error, CallEnded):
        return False
    task = asyncio.current_task()
    return task is not None and task.cancelling() == 0 and not context.done()


async def end_stray_cancel(context: grpc.aio.ServicerContext, method: str) -> NoReturn:
    """In that ``except``: ends the call INTERNAL, the traceback logged."""
    logger.error("%s: the handler was cancelled, not its call; the call ends INTERNAL",
                 method, exc_info=True)
    await abort_call(context, grpc.StatusCode.INTERNAL,
                     f"the server cancelled its own handling of {method} (a "
                     "server fault: its log has where)")
